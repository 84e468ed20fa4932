"""The GPU memory budget: what a prepared model keeps on the accelerator, in order, within ``gpu_memory`` bytes.

    1. the non-expert weights and buffers (measured: ``torch.cuda.memory_allocated`` after placement);
    2. a reserve for the KV cache (``KV_TOKENS`` tokens of the model's static cache) and prefill activations;
    3. the staging of the routing-aware prefill split (ktorch/ops/routed_experts.py): packed bytes and dequantized
       weights of up to one layer's experts;
    4. resident experts: the rest, the same count n in every MoE layer, held packed as the CPU op holds them (int8:
       half a bf16 copy), plus one scratch of n dequantized experts that a long call's residents are dequantized
       into; each layer keeps its most routed-to experts (counted at prefill), swapped by
       ``update_resident_experts`` outside decode when the gain passes a threshold. Decode computes their slots on
       the device and the CPU op the others: quantized residents (int8 and int4 codes with per-group scales, and
       minimums for the affine Q4_K/Q5_K codes) on CUDA with Triton are held row-major and read once by fused Triton
       kernels (ktorch/ops/resident_rows.py, docs/resident_decode.md), bf16 ones packed (``packed_experts_forward``:
       each token's K experts dequantized and multiplied). A layer whose every expert is resident makes no CPU op
       call. The swap writes the new experts into the same device buffers
       and the slot map in place, so a captured decode step stays valid.

``ktorch.prepare(..., gpu_memory="24GiB")`` / ``--gpu-memory 24GiB``; the default on a CUDA device, ``"auto"``: the
device's free memory (plus what the model already holds) minus ``FREE_MARGIN`` (measured against ``off``, every
expert in host memory, on the 48-layer Qwen3-30B-A3B-shaped Q8_0 file, H200: prefill 2060 vs 1238 tok/s, decode
130.7 vs 25.2 tok/s at 512 prompt tokens, 2026-11-26). ``"off"``: no budget, no residents. ``ktorch
serve`` gives its paged KV pool's bytes as the reserve (``reserve=``, ktorch/serve/engine.py ``kv_pool_for``),
so residents never take the pool's memory. ``model.kt_gpu_memory`` keeps the ``GpuMemoryPlan``; its ``summary()``
is what the CLI prints.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import nn

KV_TOKENS = 4096  # tokens of KV cache reserved (generate's static cache, rounded to 256 tokens)
ACTIVATION_BYTES_PER_TOKEN_HIDDEN = 256  # prefill of PREFILL_TOKENS: hidden states, attention, the device experts'
# T*K-row temporaries (gate/up, sorted rows): 1 GiB at 2048 tokens of H = 2048; generous, as running out is an error
PREFILL_TOKENS = 2048
FREE_MARGIN = 1 << 30  # left free by the default budget (CUDA context growth, allocator fragmentation)
DECAY = 0.5  # routing frequencies are scaled by this after each update, so recent prompts weigh more
MIN_GAIN = 0.02  # swap when the incoming experts' share of the counted rows beats the outgoing ones' by this

_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_memory_size(size: Union[int, str]) -> int:
    """Bytes from an int or a string: "24GiB", "24GB", "1.5 GiB", "512MiB", "123456"."""
    if isinstance(size, bool):
        raise ValueError(f"gpu_memory: expected a size like '24GiB' or a byte count, got {size!r}")
    if isinstance(size, int):
        if size < 0:
            raise ValueError(f"gpu_memory: a size must be >= 0, got {size}")
        return size
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", str(size))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"gpu_memory: {size!r} is not a size like '24GiB', '24GB', '512MiB' or a byte count")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


@dataclass
class GpuMemoryPlan:
    """Bytes by use; ``used`` never exceeds ``budget``."""

    budget: int
    weights: int  # measured after placement: non-expert weights and buffers
    reserve: int  # KV cache of KV_TOKENS tokens and prefill activations (an estimate), or the caller's (serve's pool)
    staging: int  # the routed split's staging (DeviceStaging.nbytes)
    staging_experts: int
    resident_per_layer: int
    resident: int  # all layers' resident experts (packed) and one layer's dequantized scratch for them
    layers: int
    num_experts: int

    @property
    def used(self) -> int:
        return self.weights + self.reserve + self.staging + self.resident

    def summary(self) -> str:
        g = 1 << 30
        return (f"GPU memory: budget {self.budget / g:.2f} GiB = weights {self.weights / g:.2f} + KV/activations "
                f"reserve {self.reserve / g:.2f} + prefill staging {self.staging / g:.2f} ({self.staging_experts} "
                f"experts) + resident experts {self.resident / g:.2f} ({self.resident_per_layer} of "
                f"{self.num_experts} per layer x {self.layers}); used {self.used / g:.2f} GiB")


def device_bytes_held(model: nn.Module, device: torch.device) -> int:
    """Bytes on ``device``: what the CUDA allocator holds for it, or (a CPU stand-in) the model's tensors there."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    from ktorch.integrations.transformers_experts import experts_modules

    seen, total = set(), 0
    for _, m in experts_modules(model):  # the packed experts live in host memory, whatever device stands in
        for name in ("kt_w13", "kt_w13_scales", "kt_w2", "kt_w2_scales", "kt_w13_bias", "kt_w2_bias"):
            t = getattr(m, name, None)
            if t is not None:
                seen.add(t.data_ptr())
    resident = [t for _, m in experts_modules(model) for t in getattr(m, "kt_gpu_packed", ()) if t is not None]
    for t in list(model.parameters()) + list(model.buffers()) + resident:
        if t.device == device and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def reserve_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """KV cache of ``KV_TOKENS`` tokens (all layers, keys and values) plus prefill activations, in bytes."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    size = torch.empty((), dtype=dtype).element_size()
    heads = getattr(config, "num_attention_heads", 1)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv = 2 * config.num_hidden_layers * kv_heads * head_dim * KV_TOKENS * size
    return kv + PREFILL_TOKENS * config.hidden_size * ACTIVATION_BYTES_PER_TOKEN_HIDDEN


def budget_bytes(gpu_memory: Union[int, str, None], model: nn.Module, device: torch.device) -> Optional[int]:
    """The budget that ``gpu_memory`` names: None for "off" (no budget), ``default_budget`` for "auto" (None too: the
    default of a caller that resolved it already), else the parsed size."""
    if gpu_memory == "off":
        return None
    if gpu_memory is None or gpu_memory == "auto":
        return default_budget(model, device)
    return parse_memory_size(gpu_memory)


def default_budget(model: nn.Module, device: torch.device) -> Optional[int]:
    """Free device memory plus what the model holds, minus ``FREE_MARGIN``; None on the CPU (no budget)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return max(free + torch.cuda.memory_allocated(device) - FREE_MARGIN, 0)


def resident_bytes_per_expert(module: nn.Module) -> int:
    """Device bytes of one resident expert: its packed rows of w13, w2 and their scales (MXFP4 nibbles: their int8
    codes, twice the bytes, and two-level K-quant scales their float32 form, which residents hold:
    ``_resident_tensors``)."""
    from ktorch.ops.packed_weights import MXFP4_DTYPE, kscales_as_float, packed_in_features

    w13, w2 = module.kt_w13, module.kt_w2
    s13 = kscales_as_float(None if module.kt_w13_scales is None else module.kt_w13_scales[:1], packed_in_features(w13))
    s2 = kscales_as_float(None if module.kt_w2_scales is None else module.kt_w2_scales[:1], packed_in_features(w2))
    return sum(t[0].numel() * t.element_size() * (2 if t.dtype == MXFP4_DTYPE else 1)
               for t in (w13, s13, w2, s2) if t is not None)


def dequantized_bytes_per_expert(module: nn.Module, dtype: torch.dtype) -> int:
    """Device bytes of one expert dequantized: w13 [2I, H] and w2 [H, I] in ``dtype``."""
    two_i, h = module.kt_w13.shape[1] * 16, module.kt_w2.shape[1] * 16
    return (two_i * h + h * (two_i // 2)) * torch.empty((), dtype=dtype).element_size()


def plan_gpu_memory(model: nn.Module, modules: list, budget: Optional[int], device: torch.device,
                    dtype: torch.dtype, staging_bytes_for, reserve: Optional[int] = None) -> GpuMemoryPlan:
    """How ``budget`` bytes divide (see the module docstring). ``staging_bytes_for(n)``: the staging's bytes for n
    experts, or None when the prefill split is off. ``reserve``: the bytes kept for the KV cache and activations
    before the staging and the residents (default ``reserve_bytes``: generate's static cache; ``ktorch serve``: its
    paged pool). Raises when the weights and the reserve alone exceed it."""
    E = modules[0].kt_w13.shape[0]
    weights = device_bytes_held(model, device)
    if reserve is None:
        reserve = reserve_bytes(model, dtype)
    elif isinstance(reserve, bool) or not isinstance(reserve, int) or reserve < 0:
        raise ValueError(f"gpu_memory: the reserve must be a byte count >= 0, got {reserve!r}")
    if budget is None:  # no budget (CPU stand-in): a full staging, no residents
        staging_n = E if staging_bytes_for is not None else 0
        staging = staging_bytes_for(staging_n) if staging_bytes_for is not None else 0
        return GpuMemoryPlan(weights + reserve + staging, weights, reserve, staging, staging_n, 0, 0, len(modules), E)
    left = budget - weights - reserve
    if left < 0:
        g = 1 << 30
        raise ValueError(f"gpu_memory: the budget of {budget / g:.3f} GiB is less than the model's weights on "
                         f"{device} ({weights / g:.3f} GiB) and the KV cache/activations reserve ({reserve / g:.3f} "
                         "GiB); give a larger one (or a smaller KV cache)")
    staging_n, staging = 0, 0
    if staging_bytes_for is not None:
        per = staging_bytes_for(1)
        staging_n = min(E, left // per) if per else E
        while staging_n and staging_bytes_for(staging_n) > left:  # alignment padding
            staging_n -= 1
        staging = staging_bytes_for(staging_n)
    # n residents cost their packed bytes in every layer and, once, n dequantized experts (a long call's scratch)
    per_resident = resident_bytes_per_expert(modules[0]) * len(modules) + dequantized_bytes_per_expert(modules[0], dtype)
    n = min(E, (left - staging) // per_resident) if per_resident else 0
    return GpuMemoryPlan(budget, weights, reserve, staging, staging_n, n, n * per_resident, len(modules), E)


# ---------------------------------------------------------------- resident experts


def _resident_tensors(module: nn.Module, ids: torch.Tensor, device: torch.device, rows: bool) -> tuple:
    """The packed module's experts ``ids`` on ``device``: (w13, w13_scales, w2, w2_scales) rows of the packed layout
    (scales None for bf16), or with ``rows`` the same bytes as ``RowExperts`` (ktorch/ops/resident_rows.py). MXFP4
    nibbles become their int8 codes on the device (``mxfp4_as_int8``: the same values and scales), so MXFP4 residents
    take the int8 paths (the Triton rows with ``rows``); two-level K-quant scales become their float32 form on the
    device (``kscales_as_float``), which every device path takes."""
    from ktorch.ops.packed_weights import MXFP4_DTYPE, as_bytes, kscales_as_float, mxfp4_as_int8, packed_in_features

    ids = ids.to("cpu", torch.int64)

    def selected(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == MXFP4_DTYPE:  # selected and copied as bytes (packed_weights.as_bytes)
            return mxfp4_as_int8(as_bytes(t).index_select(0, ids).to(device).view(MXFP4_DTYPE))
        return t.index_select(0, ids).to(device)

    w13, w2 = module.kt_w13, module.kt_w2
    s13, s2 = (None if s is None else kscales_as_float(selected(s), packed_in_features(w))
               for s, w in ((module.kt_w13_scales, w13), (module.kt_w2_scales, w2)))
    packed = (selected(w13), s13, selected(w2), s2)
    if rows:
        from ktorch.ops.resident_rows import rows_from_packed

        return rows_from_packed(*packed)
    return packed


def place_resident_experts(module: nn.Module, n: int, device: torch.device,
                           initial: Optional[torch.Tensor] = None) -> None:
    """Keeps ``n`` experts of the packed ``module`` on ``device`` (``kt_gpu_packed``): ``initial`` ids, else the
    most routed-to so far (``kt_routed.frequency``), else the first n. Int8/int4 experts with per-group scales (and
    minimums) on CUDA with Triton are held row-major (``RowExperts``, decoded by the Triton kernels:
    ktorch/ops/resident_rows.py ``row_layout_applies``), bf16 ones in the packed layout (``packed_experts_forward``).
    Their slots are masked from the CPU op and computed on the device; ``kt_gpu_hits`` counts the slots they take."""
    from ktorch.integrations.transformers_experts import _check_device_experts
    from ktorch.ops.resident_rows import row_layout_applies

    _check_device_experts(module, "place_resident_experts")
    E = module.kt_w13.shape[0]
    if initial is None:
        routed = getattr(module, "kt_routed", None)
        frequency = routed.frequency if routed is not None else torch.zeros(E, dtype=torch.float64)
        initial = torch.argsort(-frequency, stable=True)[:n]
    ids = torch.sort(initial.to(torch.int64)).values
    if ids.numel() != n or (n and (ids.unique().numel() != n or ids.min() < 0 or ids.max() >= E)):
        raise ValueError(f"place_resident_experts: need {n} distinct expert ids in [0, {E}), got {ids.tolist()}")
    slot_of = torch.full((E,), -1, dtype=torch.int64)
    slot_of[ids] = torch.arange(n)
    with torch.inference_mode(False):  # updated in place from inside and outside inference mode
        rows = row_layout_applies(module.kt_w13, module.kt_w13_scales, module.kt_w2, module.kt_w2_scales, device)
        module.kt_gpu_packed = _resident_tensors(module, ids, device, rows)
        module.register_buffer("kt_gpu_slot_of", slot_of.to(device), persistent=False)
        hits = torch.zeros((), dtype=torch.int64, device=device)  # routed slots << 32 | slots on residents
    module.register_buffer("kt_gpu_hits", hits, persistent=False)
    module.kt_gpu_expert_ids = ids.tolist()
    module.kt_gpu_kernel = getattr(module, "kt_gpu_kernel", "auto")


def drop_resident_experts(module: nn.Module) -> None:
    for name in ("kt_gpu_slot_of", "kt_gpu_hits"):
        if name in module._buffers:
            del module._buffers[name]
    for name in ("kt_gpu_expert_ids", "kt_gpu_packed"):
        module.__dict__.pop(name, None)


def swap_resident_experts(module: nn.Module, incoming: list, outgoing: list) -> None:
    """Replaces the resident experts ``outgoing`` by ``incoming`` (same count) in place: their rows (in the residents'
    layout, packed or ``RowExperts``) are written into the outgoing ones' slots and the slot map updated on the
    device, in stream order, so buffers a captured graph reads keep their addresses."""
    from ktorch.ops.resident_rows import RowExperts

    if len(incoming) != len(outgoing):
        raise ValueError(f"swap_resident_experts: {len(incoming)} incoming and {len(outgoing)} outgoing experts")
    if not incoming:
        return
    ids = list(module.kt_gpu_expert_ids)
    position = {e: j for j, e in enumerate(ids)}
    for e in incoming:
        if e in position:
            raise ValueError(f"swap_resident_experts: expert {e} is already resident")
    for e in outgoing:
        if e not in position:
            raise ValueError(f"swap_resident_experts: expert {e} is not resident")
    slots = [position[e] for e in outgoing]
    device = module.kt_gpu_slot_of.device
    rows = _resident_tensors(module, torch.tensor(incoming), device,  # all incoming at once, then into their slots
                             isinstance(module.kt_gpu_packed, RowExperts))
    where = torch.tensor(slots, dtype=torch.int64, device=device)
    for dst, src in zip(module.kt_gpu_packed, rows):
        if dst is not None:
            dst.index_copy_(0, where, src)
    for e, j in zip(incoming, slots):
        ids[j] = e
    slot_of = module.kt_gpu_slot_of
    index = torch.tensor(list(outgoing) + list(incoming), dtype=torch.int64)
    values = torch.tensor([-1] * len(outgoing) + slots, dtype=slot_of.dtype)
    slot_of.index_copy_(0, index.to(slot_of.device), values.to(slot_of.device))
    module.kt_gpu_expert_ids = ids


def update_resident_experts(model: nn.Module, min_gain: float = MIN_GAIN) -> dict:
    """Per MoE layer with resident experts and routing counts (``kt_routed.frequency``, from prefill splits): swaps
    in the most routed-to experts where the incoming ones' rows beat the outgoing ones' by ``min_gain`` of the
    layer's counted rows, then decays the counts (``DECAY``). Never during a decode step (ktorch.generate calls it
    after prefill, before decoding). Returns {"swapped": experts swapped, "seconds": time taken, "prefill_hits":
    (rows on residents, routed rows) counted since the last reset}, and resets those counters, so that
    ``resident_hits`` then counts the decode steps."""
    from ktorch.integrations.transformers_experts import experts_modules

    start = time.perf_counter()
    swapped = 0
    for _, m in experts_modules(model):
        routed = getattr(m, "kt_routed", None)
        ids = getattr(m, "kt_gpu_expert_ids", None)
        if routed is None or not ids:
            continue
        frequency = routed.frequency
        total = float(frequency.sum())
        if total > 0:
            want = set(torch.argsort(-frequency, stable=True)[:len(ids)].tolist())
            incoming = sorted(want - set(ids), key=lambda e: -float(frequency[e]))
            outgoing = sorted(set(ids) - want, key=lambda e: float(frequency[e]))
            pairs = [(i, o) for i, o in zip(incoming, outgoing) if frequency[i] > frequency[o]]
            gain = sum(float(frequency[i] - frequency[o]) for i, o in pairs) / total
            if pairs and gain >= min_gain:
                swap_resident_experts(m, [i for i, _ in pairs], [o for _, o in pairs])
                swapped += len(pairs)
        routed.frequency *= DECAY
    hits, rows = resident_hits(model)  # the prefill's; from here on the counters count decode
    reset_resident_hits(model)
    return {"swapped": swapped, "seconds": time.perf_counter() - start, "prefill_hits": (hits, rows)}


def resident_hits(model: nn.Module) -> tuple[int, int]:
    """(rows computed by resident experts, routed rows) counted at the layers with residents since the last
    ``reset_resident_hits``, eager and captured (CUDA graph) calls alike; slots of padding rows (id -1: ktorch
    serve's padded steps) count in neither. Reads the device counters at once (one sync)."""
    from ktorch.integrations.transformers_experts import experts_modules

    counters = [m.kt_gpu_hits for _, m in experts_modules(model) if getattr(m, "kt_gpu_hits", None) is not None]
    if not counters:
        return 0, 0
    packed = torch.stack([c.reshape(()) for c in counters]).cpu().tolist()
    return sum(p & 0xFFFFFFFF for p in packed), sum(p >> 32 for p in packed)


def reset_resident_hits(model: nn.Module) -> None:
    from ktorch.integrations.transformers_experts import experts_modules

    for _, m in experts_modules(model):
        counter = getattr(m, "kt_gpu_hits", None)
        if counter is not None:
            counter.zero_()
