"""The GPU memory budget: what a prepared model keeps on the accelerator, in order, within ``gpu_memory`` bytes.

    1. the non-expert weights and buffers (measured: ``torch.cuda.memory_allocated`` after placement);
    2. a reserve for the KV cache (``KV_TOKENS`` tokens of the model's static cache) and prefill activations;
    3. the staging of the routing-aware prefill split (ktorch/ops/routed_experts.py): packed bytes and dequantized
       weights of up to one layer's experts;
    4. resident experts: the rest, the same count n in every MoE layer, held packed as the CPU op holds them (int8:
       half a bf16 copy), plus one scratch of n dequantized experts that a long call's residents are dequantized
       into, except where every call reads them in place (int8 rows under the Triton kernels:
       ``residents_read_in_place``); each layer keeps its most routed-to experts (counted at prefill; the first ones
       from an expert profile where given, else from the load-time warm-up's routing, ``seed_resident_experts``,
       by the swap rule below). After each prefill
       ``begin_resident_swaps`` swaps an expert in only where its count beats the resident it replaces by more
       than the hysteresis (``SWAP_HYSTERESIS`` of that count), the noise (``SWAP_SIGMAS`` standard deviations)
       and the copy's cost (``SWAP_HORIZON_TOKENS``), so repeated or one-off prompts do not churn the set; the
       copies run on a side stream from the page-locked packed experts behind decode (the outgoing experts go to
       the CPU op meanwhile), never in a decode step. Decode computes their slots on
       the device and the CPU op the others: quantized residents (int8 and int4 codes with per-group scales, and
       minimums for the affine Q4_K/Q5_K codes) on CUDA with Triton are held row-major and read once by fused Triton
       kernels (ktorch/ops/resident_rows.py, docs/resident_decode.md), bf16 ones packed (``packed_experts_forward``:
       each token's K experts dequantized and multiplied). A layer whose every expert is resident makes no CPU op
       call. The swap writes the new experts into the same device buffers
       and the slot map in place, so a captured decode step stays valid.

``ktorch.prepare(..., gpu_memory="24GiB")`` / ``--gpu-memory 24GiB``; the default on a CUDA device, ``"auto"``: the
device's free memory (plus what the model already holds) minus ``FREE_MARGIN`` (measured against ``off``, every
expert in host memory, on the 48-layer Qwen3-30B-A3B-shaped Q8_0 file, H200: prefill 3007 vs 1224 tok/s, decode
124.7 vs 34.3 tok/s at 512 prompt tokens, 2026-11-26; benchmarks/RESULTS.md section 2). ``"off"``: no budget, no residents. ``ktorch
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
ACTIVATION_BYTES_PER_TOKEN_HIDDEN = 384  # prefill of PREFILL_TOKENS: hidden states, attention, the device experts'
# T*K-row temporaries (gate/up, sorted rows), and the captured prefills' pool (ktorch.generation keeps the 2048- and
# 512-token graphs, whose freed blocks stay reserved): 1.5 GiB at 2048 tokens of H = 2048 (256 until session 56: the
# card then held ~0.6 GiB more than the plan outside the context)
PREFILL_TOKENS = 2048
FREE_MARGIN = 512 << 20  # left free by the default budget (allocator fragmentation; 1 GiB until the plan counted the
# context's growth itself, OUTSIDE_GROWTH below: the same room in all)
# The budget is the process's device memory as nvidia-smi shows it: the allocator's blocks and what lies outside them
# (the CUDA context, loaded kernels), measured when the plan is made (``outside_allocator``) and counted up to this
# cap (beyond it the device's other processes are the likelier holders; on a shared GPU the figure errs on the safe
# side). Session 56, H200 host, the 48-layer Q8_0 file at 24GiB: the plan counted only allocator bytes and the card
# showed 24.92-24.98 GiB in use (benchmarks/gpu_use.py) with 23.20 allocated at the peak.
OUTSIDE_CAP = 2 << 30
# ... and what they grow by after the plan (kernels loaded by the first prompts and the decode step's capture):
# session 56 calls 3-4 (the plan counting them as measured, without this): the allocator's peak stayed inside its
# share (peak reserved 23.39 GiB), the bytes outside it ended at 0.84 GiB, at least 0.32 more than when planned,
# and one process of four showed 24.14 GiB by nvidia-smi for its 24
OUTSIDE_GROWTH = 512 << 20
DECAY = 0.5  # routing frequencies are scaled by this after each update, so recent prompts weigh more
# A resident swap (resident_swap_pairs) needs the incoming expert's routing count f_i to beat the outgoing one's f_o
# by more than SWAP_HYSTERESIS * f_o + SWAP_SIGMAS * sqrt(f_i + f_o), and the copy to pay for itself within
# SWAP_HORIZON_TOKENS decode tokens (measured costs); SWAP_CHUNK experts a layer are staged on the device at a time.
SWAP_HYSTERESIS = 0.25
SWAP_SIGMAS = 3.0
SWAP_HORIZON_TOKENS = 256
SWAP_CHUNK = 16

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
    resident: int  # all layers' resident experts (packed) and, where calls need it, one layer's dequantized scratch
    layers: int
    num_experts: int
    outside: int = 0  # the process's device bytes outside the allocator when planned (CUDA context, kernels) and
    # their allowance to grow (OUTSIDE_GROWTH)

    @property
    def used(self) -> int:
        return self.outside + self.weights + self.reserve + self.staging + self.resident

    def summary(self) -> str:
        g = 1 << 30
        return (f"GPU memory: budget {self.budget / g:.2f} GiB = CUDA context {self.outside / g:.2f} + weights "
                f"{self.weights / g:.2f} + KV/activations reserve {self.reserve / g:.2f} + prefill staging "
                f"{self.staging / g:.2f} ({self.staging_experts} experts) + resident experts {self.resident / g:.2f} "
                f"({self.resident_per_layer} of {self.num_experts} per layer x {self.layers}); used {self.used / g:.2f} GiB")


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


def outside_allocator(device: torch.device) -> int:
    """The device bytes in use beyond the caching allocator's blocks (``memory_reserved``): the CUDA context and
    loaded kernels of this process, and other processes' memory, counted up to ``OUTSIDE_CAP``; 0 off CUDA."""
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    return min(max(total - free - torch.cuda.memory_reserved(device), 0), OUTSIDE_CAP)


def planned_outside(device: torch.device) -> int:
    """What a plan made now counts outside the allocator: ``outside_allocator`` plus ``OUTSIDE_GROWTH`` on CUDA."""
    return outside_allocator(device) + (OUTSIDE_GROWTH if device.type == "cuda" else 0)


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
    """Free device memory plus what the process holds there (the model's allocated bytes and what lies outside the
    allocator, ``outside_allocator``), minus ``FREE_MARGIN``; None on the CPU (no budget)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return max(free + torch.cuda.memory_allocated(device) + outside_allocator(device) - FREE_MARGIN, 0)


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


def residents_read_in_place(module: nn.Module, device: torch.device, dtype: torch.dtype, kernel: str = "auto") -> bool:
    """Whether every call on ``module``'s residents on ``device`` reads their codes where they lie, so that they need
    no dequantized scratch: int8 rows (``RowExperts``, ktorch/ops/resident_rows.py) with activations of ``dtype``
    bf16/fp16 and ``kernel`` auto, which decode's Triton kernels and a prefill's grouped Triton GEMM
    (``triton_prefill.triton_grouped_forward``) take at every tile (``TILES``). Decided on one expert's rows made on
    the CPU, the same bytes the residents hold."""
    from ktorch.ops import triton_prefill
    from ktorch.ops.resident_rows import row_layout_applies

    if kernel != "auto" or dtype not in (torch.bfloat16, torch.float16):
        return False
    if not row_layout_applies(module.kt_w13, module.kt_w13_scales, module.kt_w2, module.kt_w2_scales, device):
        return False
    one = _resident_tensors(module, torch.zeros(1, dtype=torch.int64), torch.device("cpu"), rows=True)
    return triton_prefill.every_tile_takes(one)


def plan_gpu_memory(model: nn.Module, modules: list, budget: Optional[int], device: torch.device,
                    dtype: torch.dtype, staging_bytes_for, reserve: Optional[int] = None,
                    kernel: str = "auto") -> GpuMemoryPlan:
    """How ``budget`` bytes divide (see the module docstring). ``staging_bytes_for(n)``: the staging's bytes for n
    experts, or None when the prefill split is off. ``reserve``: the bytes kept for the KV cache and activations
    before the staging and the residents (default ``reserve_bytes``: generate's static cache; ``ktorch serve``: its
    paged pool). The residents' dequantized scratch is counted only where a call can need it
    (``residents_read_in_place``; ``kernel`` the device experts' kernel). Raises when the weights and the reserve
    alone exceed it."""
    E = modules[0].kt_w13.shape[0]
    weights = device_bytes_held(model, device)
    outside = planned_outside(device)
    if reserve is None:
        reserve = reserve_bytes(model, dtype)
    elif isinstance(reserve, bool) or not isinstance(reserve, int) or reserve < 0:
        raise ValueError(f"gpu_memory: the reserve must be a byte count >= 0, got {reserve!r}")
    if budget is None:  # no budget (CPU stand-in): a full staging, no residents
        staging_n = E if staging_bytes_for is not None else 0
        staging = staging_bytes_for(staging_n) if staging_bytes_for is not None else 0
        return GpuMemoryPlan(outside + weights + reserve + staging, weights, reserve, staging, staging_n, 0, 0,
                             len(modules), E, outside)
    left = budget - outside - weights - reserve
    if left < 0:
        g = 1 << 30
        raise ValueError(f"gpu_memory: the budget of {budget / g:.3f} GiB is less than the model's weights on {device} "
                         f"({weights / g:.3f} GiB), the KV cache/activations reserve ({reserve / g:.3f} GiB) and the "
                         f"CUDA context ({outside / g:.3f} GiB); give a larger one (or a smaller KV cache)")
    staging_n, staging = 0, 0
    if staging_bytes_for is not None:
        per = staging_bytes_for(1)
        staging_n = min(E, left // per) if per else E
        while staging_n and staging_bytes_for(staging_n) > left:  # alignment padding
            staging_n -= 1
        staging = staging_bytes_for(staging_n)
    # n residents cost their packed bytes in every layer and, once, n dequantized experts (a long call's scratch),
    # unless every call reads them in place (int8 rows under the Triton kernels: the grouped GEMM at prefill)
    scratch = 0 if residents_read_in_place(modules[0], device, dtype, kernel) else \
        dequantized_bytes_per_expert(modules[0], dtype)
    per_resident = resident_bytes_per_expert(modules[0]) * len(modules) + scratch
    n = min(E, (left - staging) // per_resident) if per_resident else 0
    return GpuMemoryPlan(budget, weights, reserve, staging, staging_n, n, n * per_resident, len(modules), E, outside)


# ---------------------------------------------------------------- resident experts


def _copy_runs(source: torch.Tensor, ids: list, out: torch.Tensor) -> torch.Tensor:
    """``out[j] = source[ids[j]]``, one non-blocking copy per run of consecutive ids (``contiguous_runs``, as the
    prefill split copies); returns ``out``."""
    from ktorch.ops.routed_experts import contiguous_runs

    j = 0
    for first, end in contiguous_runs(ids):
        out[j:j + end - first].copy_(source[first:end], non_blocking=True)
        j += end - first
    return out


def _resident_tensors(module: nn.Module, ids: torch.Tensor, device: torch.device, rows: bool) -> tuple:
    """The packed module's experts ``ids`` on ``device``: (w13, w13_scales, w2, w2_scales) rows of the packed layout
    (scales None for bf16), or with ``rows`` the same bytes as ``RowExperts`` (ktorch/ops/resident_rows.py). MXFP4
    nibbles become their int8 codes on the device (``mxfp4_as_int8``: the same values and scales), so MXFP4 residents
    take the int8 paths (the Triton rows with ``rows``); two-level K-quant scales become their float32 form on the
    device (``kscales_as_float``), which every device path takes."""
    from ktorch.ops.packed_weights import MXFP4_DTYPE, as_bytes, kscales_as_float, mxfp4_as_int8, packed_in_features

    ids = ids.to("cpu", torch.int64)
    id_list = ids.tolist()
    layer = getattr(getattr(module, "kt_routed", None), "layer", None)
    pinned = {}  # the split's page-locked copies of the packed tensors (all experts), by tensor
    if device.type == "cuda" and layer is not None and layer.pinned_experts == module.kt_w13.shape[0]:
        pinned = {id(t): src for t, src in zip(layer.tensors, layer.sources) if t is not None}

    def selected(t: torch.Tensor) -> torch.Tensor:  # MXFP4 selected and copied as bytes (packed_weights.as_bytes)
        source = pinned.get(id(t))
        b = as_bytes(t if source is None else source)
        if source is not None:  # non-blocking DMA, one copy per run of consecutive ids
            out = _copy_runs(b, id_list, torch.empty((len(id_list),) + tuple(b.shape[1:]), dtype=b.dtype,
                                                     device=device))
        elif device.type == "cuda" and len(id_list) <= SWAP_CHUNK:  # a swap's chunk: gathered into page-locked
            # memory, then non-blocking (a placement's many experts go the blocking way: no pinned block that large)
            host = torch.empty((len(id_list),) + tuple(b.shape[1:]), dtype=b.dtype, pin_memory=True)
            out = torch.index_select(b, 0, ids, out=host).to(device, non_blocking=True)
        else:
            out = b.index_select(0, ids).to(device)
        return mxfp4_as_int8(out.view(MXFP4_DTYPE)) if t.dtype == MXFP4_DTYPE else out

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


def resident_swap_pairs(frequency: torch.Tensor, resident: list, min_rows: float = 0.0) -> list:
    """The (incoming, outgoing) expert pairs worth a swap, by routing counts ``frequency`` [E] (rows per expert) and
    the ``resident`` ids: the non-residents among the top len(resident), most routed first, against the least routed
    residents outside it. A pair swaps only when the incoming count f_i beats the outgoing one f_o by more than
    ``SWAP_HYSTERESIS`` of f_o (a resident set within that of the best one stays, however often the same routing
    repeats), by more than ``SWAP_SIGMAS`` standard deviations of the difference of two counts (sqrt(f_i + f_o):
    one prompt's noise does not churn the set) and by at least ``min_rows`` (the rows that pay for the copy:
    ``_copy_rows``)."""
    frequency = frequency.to("cpu", torch.float64)
    n = len(resident)
    held = set(resident)
    want = torch.argsort(-frequency, stable=True)[:n].tolist()
    incoming = [e for e in want if e not in held]  # most routed first
    outgoing = sorted(held - set(want), key=lambda e: (float(frequency[e]), e))  # least routed first
    pairs = []
    for i, o in zip(incoming, outgoing):
        fi, fo = float(frequency[i]), float(frequency[o])
        if fi - fo > SWAP_HYSTERESIS * fo + SWAP_SIGMAS * (fi + fo) ** 0.5 and fi - fo >= min_rows:
            pairs.append((i, o))
    return pairs


def _copy_rows(model: nn.Module, module: nn.Module, counts: Optional[torch.Tensor] = None) -> float:
    """Routing rows (in the units of ``kt_routed.frequency``, or of ``counts``) an incoming expert must gain over the
    outgoing one for the copy to pay for itself: the copy takes bytes / h2d seconds; each decode token routed to the
    expert off the device costs the CPU op about cpu_expert_s + cpu_row_s; over ``SWAP_HORIZON_TOKENS`` decode tokens, a gain of g
    rows among the R counted (R / top_k tokens) saves g top_k / R x horizon such misses. 0 without measured costs
    (``model.kt_split_costs`` None: the split off)."""
    costs = getattr(model, "kt_split_costs", None)
    miss_s = 0.0 if costs is None else costs.cpu_expert_s + costs.cpu_row_s
    if costs is None or miss_s <= 0 or costs.h2d_bytes_per_s <= 0:
        return 0.0
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    top_k = getattr(config, "num_experts_per_tok", None) or 8
    counted = float((module.kt_routed.frequency if counts is None else counts).sum())
    copy_s = resident_bytes_per_expert(module) / costs.h2d_bytes_per_s
    return copy_s * counted / (top_k * SWAP_HORIZON_TOKENS * miss_s)


def _small_index(values: list, device: torch.device) -> torch.Tensor:
    """An int64 index on ``device`` without a host sync (page-locked, non-blocking on CUDA)."""
    t = torch.tensor(values, dtype=torch.int64)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _check_swap(module: nn.Module, incoming: list, outgoing: list) -> list:
    """The slots of ``outgoing``; ValueError unless ``incoming`` are distinct non-residents of the same count."""
    if len(incoming) != len(outgoing):
        raise ValueError(f"swap_resident_experts: {len(incoming)} incoming and {len(outgoing)} outgoing experts")
    position = {e: j for j, e in enumerate(module.kt_gpu_expert_ids)}
    for e in incoming:
        if e in position:
            raise ValueError(f"swap_resident_experts: expert {e} is already resident")
    if len(set(incoming)) != len(incoming) or len(set(outgoing)) != len(outgoing):
        raise ValueError(f"swap_resident_experts: repeated experts in {incoming} / {outgoing}")
    for e in outgoing:
        if e not in position:
            raise ValueError(f"swap_resident_experts: expert {e} is not resident")
    return [position[e] for e in outgoing]


def _write_residents(module: nn.Module, incoming: list, slots: list) -> None:
    """Writes experts ``incoming`` into the residents' ``slots`` (their layout, packed or ``RowExperts``), at most
    ``SWAP_CHUNK`` experts staged on the device at a time, on the current stream; reads the page-locked copies of
    the packed experts where the split holds them (non-blocking DMA)."""
    from ktorch.ops.resident_rows import RowExperts

    device = module.kt_gpu_slot_of.device
    rows = isinstance(module.kt_gpu_packed, RowExperts)
    order = sorted(range(len(incoming)), key=lambda j: incoming[j])  # ascending ids: contiguous runs copy at once
    for start in range(0, len(order), SWAP_CHUNK):
        chunk = order[start:start + SWAP_CHUNK]
        fresh = _resident_tensors(module, torch.tensor([incoming[j] for j in chunk]), device, rows)
        where = _small_index([slots[j] for j in chunk], device)
        for dst, src in zip(module.kt_gpu_packed, fresh):
            if dst is not None:
                dst.index_copy_(0, where, src)


def swap_resident_experts(module: nn.Module, incoming: list, outgoing: list) -> None:
    """Replaces the resident experts ``outgoing`` by ``incoming`` (same count) in place, now: their rows (in the
    residents' layout, packed or ``RowExperts``) are written into the outgoing ones' slots and the slot map updated
    on the device, in stream order, so buffers a captured graph reads keep their addresses. (``generate`` swaps
    behind decode instead: ``begin_resident_swaps``.)"""
    slots = _check_swap(module, list(incoming), list(outgoing))
    if not slots:
        return
    _write_residents(module, list(incoming), slots)
    _flip_slots(module, list(incoming), list(outgoing), slots)()


def _flip_slots(module: nn.Module, incoming: list, outgoing: list, slots: list):
    """A function that points the slot map at the incoming experts (and the host's resident ids), stream-ordered
    and without a host sync: its index tensors are made now."""
    device = module.kt_gpu_slot_of.device
    index = _small_index(list(outgoing) + list(incoming), device)  # outgoing -1 (already, behind decode), incoming
    values = _small_index([-1] * len(outgoing) + list(slots), device)
    ids = list(module.kt_gpu_expert_ids)
    for e, j in zip(incoming, slots):
        ids[j] = e

    def flip() -> None:
        module.kt_gpu_slot_of.index_copy_(0, index, values.to(module.kt_gpu_slot_of.dtype))
        module.kt_gpu_expert_ids = ids

    return flip


_SWAP_STREAMS: dict = {}  # device -> the side stream resident copies run on


class ResidentSwaps:
    """Resident swaps started by ``begin_resident_swaps``: ``swapped`` experts, ``seconds`` the host spent starting
    them, ``prefill_hits`` (rows on residents, routed rows) of the prefill. On CUDA the copies run on a side stream
    behind decode; ``poll()`` between decode steps points the slot maps at the new experts once they have landed
    (stream-ordered, no host sync), ``finish()`` does it in stream order whatever the copies' progress (the stream
    waits for them; the host does not)."""

    def __init__(self, prefill_hits: tuple):
        self.swapped, self.seconds, self.prefill_hits = 0, 0.0, prefill_hits
        self._flips: list = []
        self._event = None  # recorded on the side stream after the copies (CUDA), with its device
        self._event_device = None

    @property
    def pending(self) -> bool:
        return bool(self._flips)

    def poll(self) -> bool:
        """True once nothing is pending (the slot maps flipped now if the copies are done)."""
        if self._flips and (self._event is None or self._event.query()):
            self._flip()
        return not self._flips

    def finish(self) -> None:
        if self._flips:
            if self._event is not None:
                torch.cuda.current_stream(self._event_device).wait_event(self._event)
            self._flip()

    def _flip(self) -> None:
        for flip in self._flips:
            flip()
        self._flips, self._event = [], None


def begin_resident_swaps(model: nn.Module) -> ResidentSwaps:
    """Per MoE layer with resident experts and routing counts (``kt_routed.frequency``, from prefill splits): the
    pairs ``resident_swap_pairs`` finds worth a copy (hysteresis, noise and copy cost), then the counts decay
    (``DECAY``). The prefill's hit counters are read and reset first, so ``resident_hits`` then counts decode.

    The swaps, off the decode critical path: the outgoing experts leave the slot maps at once, in stream order (their
    slots go to the CPU op, which holds every expert), the incoming ones are copied on a side stream from the
    page-locked packed experts (non-blocking; ``SWAP_CHUNK`` experts staged at a time) into the outgoing ones' slots,
    which no step reads any more, and the slot maps point at them when ``poll()`` finds the copies done between two
    decode steps (or at ``finish()``). Buffers keep their addresses, so a captured decode step stays valid. On the
    CPU (a stand-in device) everything is done before it returns."""
    from ktorch.integrations.transformers_experts import experts_modules

    start = time.perf_counter()
    previous = getattr(model, "kt_resident_swaps", None)
    if previous is not None:  # a call that did not finish them (an error mid-decode)
        previous.finish()
    swaps = ResidentSwaps(resident_hits(model))  # the prefill's; from here on the counters count decode
    model.kt_resident_swaps = swaps
    reset_resident_hits(model)
    plans = []
    for _, m in experts_modules(model):
        routed = getattr(m, "kt_routed", None)
        ids = getattr(m, "kt_gpu_expert_ids", None)
        if routed is None or not ids:
            continue
        if float(routed.frequency.sum()) > 0:
            pairs = resident_swap_pairs(routed.frequency, ids, _copy_rows(model, m))
            if pairs:
                incoming, outgoing = [i for i, _ in pairs], [o for _, o in pairs]
                plans.append((m, incoming, outgoing, _check_swap(m, incoming, outgoing)))
        routed.frequency *= DECAY
    if not plans:
        swaps.seconds = time.perf_counter() - start
        return swaps
    device = plans[0][0].kt_gpu_slot_of.device
    if device.type != "cuda":
        for m, incoming, outgoing, slots in plans:
            swap_resident_experts(m, incoming, outgoing)
            swaps.swapped += len(incoming)
        swaps.seconds = time.perf_counter() - start
        return swaps
    compute = torch.cuda.current_stream(device)
    for m, incoming, outgoing, slots in plans:  # the outgoing experts go to the CPU op from the next step on
        m.kt_gpu_slot_of.index_fill_(0, _small_index(outgoing, device), -1)
        swaps._flips.append(_flip_slots(m, incoming, outgoing, slots))
        swaps.swapped += len(incoming)
    side = _SWAP_STREAMS.get(device)
    if side is None:
        side = _SWAP_STREAMS[device] = torch.cuda.Stream(device)
    side.wait_stream(compute)  # steps before the unmapping are done before a slot is overwritten
    with torch.cuda.stream(side):
        for m, incoming, outgoing, slots in plans:
            _write_residents(m, incoming, slots)
        swaps._event = torch.cuda.Event()
        swaps._event.record(side)
    swaps._event_device = device
    swaps.seconds = time.perf_counter() - start
    return swaps


def seed_resident_experts(model: nn.Module, routing: dict) -> int:
    """The first residents from a prefill's routing (the load-time warm-up's): for each module in ``routing`` {module:
    rows per expert [E]}, the pairs ``resident_swap_pairs`` finds worth a copy by those counts swapped now
    (``swap_resident_experts``, in stream order), the module's own counters left as they are (its routing
    frequency sees prompts only); returns the experts swapped."""
    swapped = 0
    for m, counts in routing.items():
        ids = getattr(m, "kt_gpu_expert_ids", None)
        if not ids or float(counts.sum()) <= 0:
            continue
        pairs = resident_swap_pairs(counts, ids, _copy_rows(model, m, counts))
        if pairs:
            swap_resident_experts(m, [i for i, _ in pairs], [o for _, o in pairs])
            swapped += len(pairs)
    return swapped


def update_resident_experts(model: nn.Module) -> dict:
    """``begin_resident_swaps`` finished at once (in stream order): returns {"swapped": experts swapped,
    "seconds": the host's time, "prefill_hits": (rows on residents, routed rows) counted since the last reset}."""
    swaps = begin_resident_swaps(model)
    swaps.finish()
    return {"swapped": swaps.swapped, "seconds": swaps.seconds, "prefill_hits": swaps.prefill_hits}


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
