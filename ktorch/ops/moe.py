"""Python face of the fused-MoE ops: packing expert weights and running routed experts on the CPU.

The ops themselves are ``torch.ops.kt.*`` (schemas in ktorch/csrc/ops.cpp); this module adds argument
handling for the layouts transformers uses, a ``PackedExperts`` container, and the fake impls that let
``torch.compile`` trace the ops without running them.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Optional, Union

import numpy as np
import torch

from ktorch import config
from ktorch.ops.packed_weights import INT4_DTYPES, MXFP4_CODES, MXFP4_DTYPE
from ktorch.ops.numa_split import NumaSplitExperts, fused_moe_split, numa_split_count, split_packed_experts

FORMATS = ("bf16", "int8", "int4")


@dataclass
class PackedExperts:
    """Expert weights of one MoE layer in the kernels' packed layout (see ktorch/csrc/kernels/kernels.h).

    w13: gate and up projections packed together ([E, 2I/16, H/per, 16, per]), or the up projection alone for
    gateless experts (``has_gate`` False: [E, I/16, H/per, 16, per], h = act(up)); w2: down projection
    ([E, H/16, I/per, 16, per]); the scales are float32 [E, G, N] for int8 (G = 1) and int4 (G = K / group)
    and None for bf16. GGUF experts kept exact (``format`` "gguf:<types>", e.g. "gguf:Q4_K/Q6_K";
    ``pack_quantized``) hold int8 scales per group of 16 or 32 too, and the affine types (Q4_K, Q5_K) scales and
    minimums [E, 2, G, N] (W = q * scale - min), the K-quants' at the file's size (two-level uint8/int8, ``pack_kscales``)
    and Q8_0's as float16; w13 and w2 may then differ in format (int4 gate/up, int8 down). w13_bias (float32 [E, 2I]: gate biases then up biases; [E, I] gateless) and w2_bias
    (float32 [E, H]) are the experts' biases, or None.
    """

    w13: torch.Tensor
    w13_scales: Optional[torch.Tensor]
    w2: torch.Tensor
    w2_scales: Optional[torch.Tensor]
    format: str
    group_size: Optional[int] = None
    w13_bias: Optional[torch.Tensor] = None
    w2_bias: Optional[torch.Tensor] = None
    # KT_NUMA_SPLIT on a plain PackedExperts: fused_moe splits it once and keeps the split here
    _numa_split_cache: Optional[object] = field(default=None, repr=False, compare=False)

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w2.shape[1] * 16

    @property
    def intermediate_size(self) -> int:
        return self.w2.shape[2] * (8 if self.w2.dtype in INT4_DTYPES else self.w2.shape[4])

    @property
    def has_gate(self) -> bool:
        """False for gateless experts (w13 holds the up projection only: its N is I, not 2I)."""
        return self.w13.shape[1] * 16 != self.intermediate_size

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.tensors(), *self.biases()) if t is not None)

    def tensors(self) -> tuple:
        """The packed weights and scales: (w13, w13_scales, w2, w2_scales)."""
        return (self.w13, self.w13_scales, self.w2, self.w2_scales)

    def biases(self) -> tuple:
        """(w13_bias, w2_bias), each None when absent."""
        return (self.w13_bias, self.w2_bias)

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights these packed tensors stand for: (gate_up_proj [E, 2I, H] (gateless: up_proj [E, I, H]),
        down_proj [E, H, I]), fp32."""
        gate_up = torch.ops.kt.unpack(self.w13, self.w13_scales, gate_up=self.has_gate)
        down = torch.ops.kt.unpack(self.w2, self.w2_scales, gate_up=False)
        return gate_up, down

    def split_numa(self, n: Union[int, str, None] = None):
        """These experts cut into n slices of the intermediate dimension, slice g in NUMA node g's memory.

        n: slices; "auto": one per NUMA node; None: ``KT_NUMA_SPLIT`` (unset: 1). Returns a
        ``NumaSplitExperts`` (ktorch/ops/numa_split.py) that ``fused_moe`` accepts; this object is left as is.
        Raises if I cannot be cut into n slices of multiples of 32 channels (int4: and of the group size), and for
        biased or gateless experts, which the split does not run.
        """
        if self.w13_bias is not None or self.w2_bias is not None or not self.has_gate:
            raise RuntimeError("split_numa: cannot split biased or gateless experts (kt.fused_moe_numa has no biases "
                               "and cuts w13 as gate/up pairs)")
        return split_packed_experts(self, n)


def _pack(weight: torch.Tensor, fmt: str, group_size: Optional[int], gate_up: bool):
    if fmt == "bf16":
        return torch.ops.kt.pack_bf16(weight, gate_up=gate_up), None
    if fmt == "int8":
        return torch.ops.kt.pack_int8(weight, gate_up=gate_up)
    K = weight.shape[-1]  # two-level scales where they fit (int4_two_level)
    return torch.ops.kt.pack_int4(weight, group_size=group_size, gate_up=gate_up,
                                  two_level=int4_two_level(K, group_size))


def int4_two_level(K: int, group_size: int) -> bool:
    """Whether ``pack_experts`` gives int4 weights with K input channels two-level scales: a byte sub-scale per group
    (1..15, chosen for the least squared error: 13% less weight error than the float32 form's absmax / 7 on Gaussian
    rows) and one float32 super-scale per row (stored per 256 input channels, ``pack_kscales``' layout), which
    needs K a multiple of 256 and groups dividing 256; float32 per group otherwise. The AMX walk sums the whole of K
    in its tiles on the two-level form (amx/kernels.cpp, int4s_block), one epilogue where the float32 form needs
    one a group: one Qwen3-30B-A3B layer, cold caches, H200 host, session 41, ms at T = 1 / 512 / 2048: 0.238 /
    7.217 / 18.458 against 0.238 / 7.368 / 21.118, int8 0.473 / 8.139 / 16.505 (bench_fused_moe.py)."""
    return K % 256 == 0 and 256 % group_size == 0


def _pack_gate_and_up(gate: torch.Tensor, up: torch.Tensor, fmt: str, group_size: Optional[int]):
    """``_pack(cat([gate, up], 1), gate_up=True)`` without the concatenated float copy: each half packed on its own
    (quantization is per row, so the codes and scales are the same), then their 32-row blocks interleaved as the
    gate_up layout orders them (32 gate rows, the 32 matching up rows, ...): a copy of packed bytes only."""
    (wg, sg), (wu, su) = _pack(gate, fmt, group_size, False), _pack(up, fmt, group_size, False)
    E, nb = wg.shape[:2]  # [E, I/16, K/per, 16, per]: two 16-row blocks make 32 rows
    w = empty_weights((E, nb // 2, 2, 2, *wg.shape[2:]), wg.dtype)
    torch.stack([wg.view(E, nb // 2, 2, *wg.shape[2:]), wu.view(E, nb // 2, 2, *wu.shape[2:])], dim=2, out=w)
    w = w.view(E, 2 * nb, *wg.shape[2:])
    if sg is None:
        return w, None
    if sg.dtype == torch.uint8:  # two-level [E, G + K/64, I]: the sub-scale rows, then the float32 super-scales
        K = w.shape[2] * 8
        G = sg.shape[1] - K // 64
        sub = torch.stack([sg[:, :G].reshape(E, G, -1, 32), su[:, :G].reshape(E, G, -1, 32)], dim=3)
        sups = [t[:, G:].contiguous().view(torch.float32).reshape(E, K // 256, -1, 32) for t in (sg, su)]
        sup = torch.stack(sups, dim=3).reshape(E, K // 256, -1).contiguous().view(torch.uint8)
        return w, torch.cat([sub.reshape(E, G, -1), sup.reshape(E, K // 64, -1)], dim=1).contiguous()
    G, I = sg.shape[1:]  # [E, G, I]
    s = torch.stack([sg.view(E, G, I // 32, 32), su.view(E, G, I // 32, 32)], dim=3).reshape(E, G, 2 * I)
    return w, s


def pack_experts(
    gate_up_proj: Optional[torch.Tensor] = None,
    down_proj: Optional[torch.Tensor] = None,
    dtype: str = "bf16",
    group_size: Optional[int] = None,
    *,
    gate_proj: Optional[torch.Tensor] = None,
    up_proj: Optional[torch.Tensor] = None,
    numa_split: Union[int, str, None] = 1,
    gate_up_bias: Optional[torch.Tensor] = None,
    down_bias: Optional[torch.Tensor] = None,
):
    """Packs one layer's routed experts for ``fused_moe``.

    Args:
        gate_up_proj: [E, 2I, H], gate rows first then up rows (transformers' layout); or pass
            ``gate_proj`` and ``up_proj`` ([E, I, H] each) instead; or ``up_proj`` alone for gateless experts
            (h = act(up), e.g. Nemotron-H).
        down_proj: [E, H, I].
        gate_up_bias: the experts' gate/up biases, [E, 2I] gate biases then up biases ([E, I], the up biases, for
            gateless experts); down_bias: [E, H]. Kept as float32 (``PackedExperts.w13_bias``/``w2_bias``).
        dtype: "bf16", "int8" (symmetric per output channel) or "int4" (symmetric per group of
            ``group_size`` input channels, default 128).
        group_size: int4 only; a multiple of 32 dividing H and I.
        numa_split: 1 (default): a ``PackedExperts``; n >= 2, "auto" (one slice per NUMA node) or None
            (``KT_NUMA_SPLIT``): a ``NumaSplitExperts`` when that gives more than one slice
            (``PackedExperts.split_numa``).

    H and I must be multiples of 32. Packing is deterministic. Weights may be in any float dtype,
    any strides (e.g. transposed views), on the CPU; contiguous fp32 weights are read in place (no copy). int8
    and int4 raise on an inf or nan weight (naming expert, row and column group); bf16 keeps them as they are.
    """
    if dtype not in FORMATS:
        raise ValueError(f"pack_experts: dtype must be one of {FORMATS}, got {dtype!r}")
    if dtype != "int4" and group_size is not None:
        raise ValueError(f"pack_experts: group_size applies to int4 only, got group_size={group_size} with {dtype}")
    gateless = gate_up_proj is None and gate_proj is None and up_proj is not None
    if gateless:
        if up_proj.dim() != 3 or down_proj is None or down_proj.dim() != 3 or down_proj.shape != (
                up_proj.shape[0], up_proj.shape[2], up_proj.shape[1]):
            raise ValueError(f"pack_experts: gateless experts need up_proj [E, I, H] and down_proj [E, H, I], got "
                             f"{tuple(up_proj.shape)} and {None if down_proj is None else tuple(down_proj.shape)}")
        E, I, H = up_proj.shape
        for name, size in (("hidden size H", H), ("intermediate size I", I)):
            if size % 32:
                raise ValueError(f"pack_experts: {name}={size} must be a multiple of 32 (the kernels tile it by 32)")
        if dtype == "int4" and group_size is None:
            group_size = 128 if H % 128 == 0 and I % 128 == 0 else 32
        w13, s13 = _pack(up_proj, dtype, group_size, gate_up=False)
        w2, s2 = _pack(down_proj, dtype, group_size, gate_up=False)
        b13, b2 = _biases(gate_up_bias, down_bias, E, I, H, gated=False)
        packed = PackedExperts(w13, s13, w2, s2, dtype, group_size, b13, b2)
        return packed if numa_split == 1 or numa_split_count(numa_split) == 1 else packed.split_numa(numa_split)
    if gate_up_proj is None:
        if gate_proj is None or up_proj is None:
            raise ValueError("pack_experts: pass gate_up_proj, or both gate_proj and up_proj, or up_proj alone")
        if gate_proj.shape != up_proj.shape:
            raise ValueError(f"pack_experts: gate_proj {tuple(gate_proj.shape)} and up_proj {tuple(up_proj.shape)} differ")
        gate_up_proj = None
    elif gate_proj is not None or up_proj is not None:
        raise ValueError("pack_experts: pass either gate_up_proj or gate_proj/up_proj, not both")
    if down_proj is None:
        raise ValueError("pack_experts: down_proj is required")
    if gate_up_proj is None:
        if gate_proj.dim() != 3:
            raise ValueError(f"pack_experts: expected gate_proj and up_proj [E, I, H], got {tuple(gate_proj.shape)}")
        shape = (gate_proj.shape[0], 2 * gate_proj.shape[1], gate_proj.shape[2])
    else:
        shape = tuple(gate_up_proj.shape)
    if len(shape) != 3 or down_proj.dim() != 3:
        raise ValueError(
            f"pack_experts: expected gate_up_proj [E, 2I, H] and down_proj [E, H, I], got "
            f"{shape} and {tuple(down_proj.shape)}"
        )
    E, two_i, H = shape
    if down_proj.shape != (E, H, two_i // 2) or two_i % 2:
        raise ValueError(
            f"pack_experts: down_proj must be [E={E}, H={H}, I={two_i // 2}] to match gate_up_proj "
            f"{shape}, got {tuple(down_proj.shape)}"
        )
    I = two_i // 2
    for name, size in (("hidden size H", H), ("intermediate size I", I)):
        if size % 32:
            raise ValueError(f"pack_experts: {name}={size} must be a multiple of 32 (the kernels tile it by 32)")
    if dtype == "int4" and group_size is None:
        group_size = 128 if H % 128 == 0 and (two_i // 2) % 128 == 0 else 32
    if gate_up_proj is None:
        w13, s13 = _pack_gate_and_up(gate_proj, up_proj, dtype, group_size)
    else:
        w13, s13 = _pack(gate_up_proj, dtype, group_size, gate_up=True)
    w2, s2 = _pack(down_proj, dtype, group_size, gate_up=False)
    b13, b2 = _biases(gate_up_bias, down_bias, E, I, H, gated=True)
    packed = PackedExperts(w13, s13, w2, s2, dtype, group_size, b13, b2)
    if numa_split == 1:
        return packed
    return packed.split_numa(numa_split) if numa_split_count(numa_split) > 1 else packed


def _biases(gate_up_bias, down_bias, E: int, I: int, H: int, gated: bool):
    """The biases as the op takes them: contiguous float32 CPU copies, shapes checked."""
    out = []
    for name, b, shape in (("gate_up_bias", gate_up_bias, (E, 2 * I if gated else I)), ("down_bias", down_bias, (E, H))):
        if b is None:
            out.append(None)
            continue
        if tuple(b.shape) != shape or not b.is_floating_point():
            raise ValueError(f"pack_experts: {name} must be a float tensor {list(shape)}, got {b.dtype} {list(b.shape)}")
        out.append(b.detach().to("cpu", torch.float32).contiguous().clone())
    return tuple(out)


def fused_moe(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    packed,
    activation: str = "silu",
) -> torch.Tensor:
    """Routed experts of one MoE layer, on the CPU.

    out[t] = sum_k topk_weights[t, k] * down_e(act(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, k];
    a negative id skips its slot.

    Args:
        hidden: [T, H] bf16, fp16 or fp32 (CPU).
        topk_ids: [T, K] int32 or int64, each < E or negative.
        topk_weights: [T, K] float.
        packed: from ``pack_experts``: a ``PackedExperts``, or a ``NumaSplitExperts`` (slices run on their NUMA
            nodes' threads at once, ``kt.fused_moe_numa``). With ``KT_NUMA_SPLIT`` > 1 a ``PackedExperts`` is
            split on its first call and the split kept on it (both copies stay in memory: split at packing
            time instead, ``pack_experts(..., numa_split=n)``, to hold one).
        activation: "silu" (SwiGLU), "gelu_tanh", "gelu", "relu", "relu2" (relu squared), or with parameters:
            "swiglu_oai(alpha=a, limit=l)" (gpt-oss: gate clamped above at l, up to [-l, l], then
            (up + 1) * gate * sigmoid(a * gate)), "silu_clamped(limit=l)" (DeepSeek-V4: the same clamps, then
            silu(gate) * up), "softcap_swiglu(gate=g, up=u)" (Inkling2: g tanh(gate / g) * sigmoid(gate) *
            u tanh(up / u)). Gateless experts (``packed.has_gate`` False) compute act(up) with the first five.
            The packed experts' biases, if any, are added to the gate/up outputs before the activation and to the
            down output before the routing weight scales it.

    Differentiable in ``hidden`` and ``topk_weights`` (ktorch/ops/moe_autograd.py; the packed weights are frozen).
    When gradients are needed, NUMA-split experts run slice by slice, one ``kt.fused_moe`` call each, summed in fp32,
    and ``KT_NUMA_SPLIT`` is not applied.

    Returns:
        [T, H] in the dtype of ``hidden``.
    """
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or topk_weights.requires_grad)
    if config.value("KT_NUMA_SPLIT") and not isinstance(packed, NumaSplitExperts) and not needs_grad:
        packed = _env_split(packed)
    if isinstance(packed, NumaSplitExperts):
        if needs_grad:  # out = sum of the slices' outputs exactly; each kt.fused_moe call has a backward
            out = None
            for s in packed.slices:
                part = torch.ops.kt.fused_moe(hidden, topk_ids, topk_weights, *s.tensors(), activation).float()
                out = part if out is None else out + part
            return out.to(hidden.dtype)
        return fused_moe_split(hidden, topk_ids, topk_weights, packed, activation)
    return torch.ops.kt.fused_moe(
        hidden, topk_ids, topk_weights, packed.w13, packed.w13_scales, packed.w2, packed.w2_scales, activation,
        packed.w13_bias, packed.w2_bias,
    )


def _env_split(packed: PackedExperts):
    """``packed`` split as ``KT_NUMA_SPLIT`` asks, made once and kept on it; ``packed`` itself when the variable
    asks for one slice, while tracing, or (with a warning, once) when its I cannot be cut into that many slices."""
    n = numa_split_count()
    if n == 1 or torch.compiler.is_compiling():
        return packed
    cached = packed._numa_split_cache
    if cached is None or (cached != "unsplittable" and cached.num_slices != n):
        try:
            cached = packed.split_numa(n)
        except RuntimeError as e:
            if "cannot split" not in str(e):
                raise
            warnings.warn(f"KT_NUMA_SPLIT={n}: runs these experts unsplit: {e}", stacklevel=3)
            cached = "unsplittable"
        packed._numa_split_cache = cached
    return packed if cached == "unsplittable" else cached


# ---------------------------------------------------------------- fake impls (shapes only, for tracing)
# A call whose tensors sit on different devices, one of them "meta" (or fake), is dispatched here rather
# than to the CPU kernel, so the device checks must be repeated here: a fake impl that returned a tensor
# for such a call would hand back uninitialized memory instead of an error.


def _check_same_device(op: str, reference: str, tensors: dict) -> None:
    device = tensors[reference].device
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise RuntimeError(f"{op}: {name} is on {t.device} but {reference} is on {device}; all tensors must be on the CPU")


def empty_weights(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor for packed weights, advised onto transparent huge pages before its first touch
    (``KT_HUGE_PAGES``, runtime/memory.h): what the pack ops allocate their outputs with."""
    out = torch.empty(shape, dtype=dtype)
    torch.ops.kt.advise_huge_pages(out)
    return out


@torch.library.register_fake("kt::advise_huge_pages")
def _advise_huge_pages_fake(t):
    return None


@torch.library.register_fake("kt::pack_bf16")
def _pack_bf16_fake(weight, gate_up=False):
    E, N, K = weight.shape
    return weight.new_empty((E, N // 16, K // 2, 16, 2), dtype=torch.bfloat16)


@torch.library.register_fake("kt::pack_int8")
def _pack_int8_fake(weight, gate_up=False):
    E, N, K = weight.shape
    return (
        weight.new_empty((E, N // 16, K // 4, 16, 4), dtype=torch.int8),
        weight.new_empty((E, 1, N), dtype=torch.float32),
    )


@torch.library.register_fake("kt::pack_int4")
def _pack_int4_fake(weight, group_size=128, gate_up=False, two_level=False):
    E, N, K = weight.shape
    return (
        weight.new_empty((E, N // 16, K // 8, 16, 4), dtype=torch.uint8),
        weight.new_empty((E, K // group_size + K // 64, N), dtype=torch.uint8) if two_level
        else weight.new_empty((E, K // group_size, N), dtype=torch.float32),
    )


# The GGUF types kt.gguf_dequantize decodes (csrc/formats/gguf.cpp) and their values per block.
GGUF_NATIVE_BLOCK_SIZES = {"Q8_0": 32, "Q4_0": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256}


@torch.library.register_fake("kt::gguf_dequantize")
def _gguf_dequantize_fake(blocks, qtype):
    return blocks.new_empty((blocks.shape[0], GGUF_NATIVE_BLOCK_SIZES[qtype]), dtype=torch.float32)


@torch.library.register_fake("kt::gguf_dequantize_into")
def _gguf_dequantize_into_fake(blocks, qtype, out):
    return None


@torch.library.register_fake("kt::unpack")
def _unpack_fake(packed, scales, gate_up=False):
    _check_same_device("unpack", "packed", {"packed": packed, "scales": scales})
    E, nb, kq, _, per = packed.shape
    K = kq * (8 if packed.dtype in INT4_DTYPES else per)
    return packed.new_empty((E, nb * 16, K), dtype=torch.float32)


@torch.library.register_fake("kt::fused_moe")
def _fused_moe_fake(hidden, topk_ids, topk_weights, w13, w13_scales, w2, w2_scales, activation="silu", w13_bias=None,
                    w2_bias=None):
    _check_same_device(
        "fused_moe",
        "hidden",
        dict(hidden=hidden, topk_ids=topk_ids, topk_weights=topk_weights, w13=w13, w13_scales=w13_scales, w2=w2,
             w2_scales=w2_scales, w13_bias=w13_bias, w2_bias=w2_bias),
    )
    for name, b in (("w13_bias", w13_bias), ("w2_bias", w2_bias)):
        torch._check(b is None or (b.dim() == 2 and b.dtype == torch.float32 and b.shape[0] == w13.shape[0]),
                     lambda: f"fused_moe: {name} must be float32 [E, N]")
    torch._check(topk_ids.shape[0] == hidden.shape[0], lambda: "fused_moe: topk_ids must have T rows")
    torch._check(hidden.shape[1] == w2.shape[1] * 16, lambda: "fused_moe: hidden size does not match w2")
    return torch.empty_like(hidden, memory_format=torch.contiguous_format)


@torch.library.register_fake("kt::fused_moe_out")
def _fused_moe_out_fake(hidden, topk_ids, topk_weights, w13, w13_scales, w2, w2_scales, activation, w13_bias, w2_bias,
                        out):
    like = _fused_moe_fake(hidden, topk_ids, topk_weights, w13, w13_scales, w2, w2_scales, activation, w13_bias,
                           w2_bias)
    torch._check(out.shape == like.shape and out.dtype == like.dtype and out.device == like.device,
                 lambda: "fused_moe_out: out must be shaped and typed like hidden")
    return None


def pack_quantized(codes: torch.Tensor, scales: torch.Tensor, mins: Optional[torch.Tensor] = None, *, bits: int,
                   gate_up: bool = False, mxfp4: bool = False, out: Optional[torch.Tensor] = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Places already-quantized weights (integer codes with a scale, and optionally a minimum, per group of input
    channels) in the op's int8 (``bits=8``) or int4 (``bits=4``) layout, without requantizing them: the weights the
    op computes with are ``codes * scale`` (``mins`` None) or ``codes * scale - min``, as the source stored them
    (GGUF blocks: ktorch/integrations/gguf_loading.py; docs/loading.md lists each type's codes and groups).

    Args:
        codes: [E, N, K] integers (any integer dtype): bits=8: in [-128, 127]; bits=4: in [-8, 7] without mins
            (stored + 8), in [0, 15] with mins (stored as they are). N output channels, K input channels.
        scales: [E, N, G] float32, one per group of K/G consecutive input channels (int8: a multiple of 16, or G = 1
            without mins; int4: a multiple of 32).
        mins: None, or [E, N, G] float32 like ``scales`` (the affine formats: GGUF Q4_K, Q5_K).
        gate_up: N = 2I rows, gate rows then up rows (as for ``pack_int8(..., gate_up=True)``).
        mxfp4: bits=4 only, no mins: the codes are MXFP4's doubled E2M1 values (0, ±1, ±2, ±3, ±4, ±6, ±8, ±12; the
            gguf package's ``MXFP4.kvalues``), stored as their nibbles (``MXFP4_CODES`` indices, 0 as +0) in a
            ``torch.float4_e2m1fn_x2`` tensor of the int4 layout, which marks them for the op: 0.5 bytes a weight
            where the int8 codes of the same blocks take 1, the same products (the op's output is that of the int8
            codes bit for bit).
        out: where to pack the weights (the packed tensor's shape and dtype, contiguous; e.g. rows of a layer's
            tensor, as the GGUF loader packs each chunk of experts in place); None: a new tensor. Used only where
            it has exactly that shape and dtype.

    Returns:
        (packed int8 [E, N/16, K/4, 16, 4] or uint8 (mxfp4: float4_e2m1fn_x2) [E, N/16, K/8, 16, 4], scales
        float32 [E, G, N], or
        [E, 2, G, N] with mins: scales then minimums), which ``kt.fused_moe`` and ``kt.unpack`` take.
    """
    if bits not in (4, 8):
        raise ValueError(f"pack_quantized: bits must be 4 or 8, got {bits}")
    if codes.dim() != 3 or scales.dim() != 3 or scales.shape[:2] != codes.shape[:2] or (
            mins is not None and mins.shape != scales.shape):
        raise ValueError(f"pack_quantized: expected codes [E, N, K], scales [E, N, G] and mins None or like scales, got "
                         f"{tuple(codes.shape)}, {tuple(scales.shape)} and {None if mins is None else tuple(mins.shape)}")
    if codes.is_floating_point():
        raise ValueError(f"pack_quantized: codes must be an integer tensor, got {codes.dtype}")
    E, N, K = codes.shape
    G = scales.shape[2]
    group = K // G if G else 0
    min_group = 32 if bits == 4 else 16
    if N % (64 if gate_up else 16) or K % 32 or G == 0 or K % G or (group % min_group and not (bits == 8 and G == 1
                                                                                              and mins is None)):
        raise ValueError(f"pack_quantized: N={N} must be a multiple of {64 if gate_up else 16}, K={K} of 32, and the "
                         f"group size K/G={K}/{G} a multiple of {min_group}")
    if mxfp4 and (bits != 4 or mins is not None):
        raise ValueError(f"pack_quantized: mxfp4 codes take bits=4 and no mins, got bits={bits}"
                         f"{' with mins' if mins is not None else ''}")
    lo, hi = (-128, 127) if bits == 8 else ((0, 15) if mins is not None else (-12, 12) if mxfp4 else (-8, 7))
    if mxfp4:
        if codes.numel() and (int(codes.min()) < lo or int(codes.max()) > hi):
            raise ValueError(f"pack_quantized: mxfp4 codes must be doubled E2M1 values {sorted(set(MXFP4_CODES))}, "
                             f"got values in [{int(codes.min())}, {int(codes.max())}]")
        nibble = np.full(256, 255, dtype=np.uint8)  # a code's byte -> its nibble (0 -> 0, not 8: +0); 255: none
        for u in reversed(range(16)):
            nibble[MXFP4_CODES[u] % 256] = u
        codes = torch.from_numpy(nibble[codes.to(torch.int8).contiguous().numpy().view(np.uint8)])
        if codes.numel() and int(codes.max()) == 255:
            raise ValueError(f"pack_quantized: mxfp4 codes must be doubled E2M1 values {sorted(set(MXFP4_CODES))}, "
                             f"got others (e.g. 5, 7, 9, 10 or 11)")
    elif codes.numel() and not (bits == 8 and codes.dtype == torch.int8) and (int(codes.min()) < lo or
                                                                              int(codes.max()) > hi):  # (int8: in range)
        raise ValueError(f"pack_quantized: {bits}-bit codes {'with' if mins is not None else 'without'} mins must lie "
                         f"in [{lo}, {hi}], got [{int(codes.min())}, {int(codes.max())}]")

    def packed_rows(t: torch.Tensor) -> torch.Tensor:  # pack.cpp's packed_row_order: 32 gate rows, then 32 up rows
        if not gate_up:
            return t
        return t.reshape(E, 2, N // 64, 32, t.shape[-1]).transpose(1, 2).reshape(E, N, t.shape[-1])

    shape = (E, N // 16, K // (4 if bits == 8 else 8), 16, 4)
    dtype = torch.int8 if bits == 8 else (MXFP4_DTYPE if mxfp4 else torch.uint8)
    if out is not None and not (out.shape == shape and out.dtype == dtype and out.is_contiguous()):
        out = None
    if bits == 8:
        # one copy of 4-byte words (a word: 4 consecutive input channels, the layout's innermost run), the gate/up
        # row interleave folded in: a copy of int8 elements through this 5-d permutation ran ~4x slower
        packed = empty_weights(shape, torch.int8) if out is None else out
        c8 = codes.to(torch.int8)
        if not c8.is_contiguous() or c8.storage_offset() % 4:  # a word view needs 4-byte aligned rows
            c8 = c8.clone(memory_format=torch.contiguous_format)
        words = c8.view(torch.int32)  # [E, N, K/4]
        target = packed.view(torch.int32).view(E, N // 16, K // 4, 16)
        if gate_up:  # source row half*N/2 + 32j + 16r + q -> packed row 64j + 32half + 16r + q
            src = words.reshape(E, 2, N // 64, 2, 16, K // 4).permute(0, 2, 1, 3, 5, 4)
            target.view(E, N // 64, 2, 2, K // 4, 16).copy_(src)
        else:
            target.copy_(words.reshape(E, N // 16, 16, K // 4).permute(0, 1, 3, 2))
    else:
        rows = packed_rows(codes)
        u = rows if mxfp4 else rows.to(torch.int16).add(8 if mins is None else 0).to(torch.uint8)  # (mxfp4: nibbles)
        t = u.reshape(E, N // 16, 16, K // 8, 2, 4).permute(0, 1, 3, 2, 4, 5)
        packed = empty_weights(shape, torch.uint8) if out is None else out.view(torch.uint8)
        torch.bitwise_or(t.select(4, 0), t.select(4, 1).bitwise_left_shift(4), out=packed)
        if mxfp4:
            packed = packed.view(MXFP4_DTYPE)
    s = packed_rows(scales.float()).transpose(1, 2)
    if mins is not None:
        s = torch.stack([s, packed_rows(mins.float()).transpose(1, 2)], dim=1)
    return packed, s.contiguous()


def pack_kscales(sub: torch.Tensor, supers: torch.Tensor, sub_mins: Optional[torch.Tensor] = None,
                 super_mins: Optional[torch.Tensor] = None, *, gate_up: bool = False) -> torch.Tensor:
    """GGUF K-quant scales at the file's size (two-level) for ``pack_quantized``'s weights of the same blocks: the
    scale of group g of row n is ``supers[n, g // (G / S)] * sub[n, g]`` (and the minimum ``super_mins * sub_mins``),
    the float32 product ``kt.fused_moe`` forms per group, exactly the float32 form's value (an fp16 d times a 6- or
    8-bit integer).

    Args:
        sub: [E, N, G] integers: uint8 0..255 (Q4_K, Q5_K's 6-bit sc) or int8 (Q6_K's sc), G groups along K.
        supers: [E, N, S] float32 (Q4_K's d, Q6_K's d), S = K / 256 (one per super-block of 256 input channels).
        sub_mins, super_mins: both None, or like sub and supers (the affine types' m and dmin).
        gate_up: as for ``pack_quantized``.

    Returns:
        uint8 (sub uint8) or int8 [E, G + 4S, N], or [E, 2, G + 4S, N] with mins: per part, the sub-scales' rows then
        the super-scales' float32 bytes (``packed_weights.kscales_as_float`` gives the float32 form).
    """
    if sub.dtype not in (torch.uint8, torch.int8) or supers.dtype != torch.float32 or sub.dim() != 3 or \
            supers.dim() != 3 or sub.shape[:2] != supers.shape[:2] or sub.shape[2] % supers.shape[2]:
        raise ValueError(f"pack_kscales: expected sub uint8/int8 [E, N, G] and supers float32 [E, N, S] with S "
                         f"dividing G, got {sub.dtype} {tuple(sub.shape)} and {supers.dtype} {tuple(supers.shape)}")
    if (sub_mins is None) != (super_mins is None) or (sub_mins is not None and (
            sub_mins.dtype != sub.dtype or sub_mins.shape != sub.shape or super_mins.shape != supers.shape or
            super_mins.dtype != torch.float32)):
        raise ValueError("pack_kscales: sub_mins and super_mins must both be None or like sub and supers")
    E, N, _ = sub.shape
    if N % (64 if gate_up else 16):
        raise ValueError(f"pack_kscales: N={N} must be a multiple of {64 if gate_up else 16}")

    def part(sb: torch.Tensor, sp: torch.Tensor) -> torch.Tensor:
        if gate_up:  # pack.cpp's packed_row_order: 32 gate rows, then 32 up rows
            sb, sp = (t.reshape(E, 2, N // 64, 32, t.shape[-1]).transpose(1, 2).reshape(E, N, t.shape[-1])
                      for t in (sb, sp))
        sup = sp.transpose(1, 2).contiguous().view(sub.dtype).reshape(E, -1, N)  # [S, N] float32 as 4S byte rows
        return torch.cat([sb.transpose(1, 2), sup], dim=1)

    out = part(sub, supers)
    if sub_mins is not None:
        out = torch.stack([out, part(sub_mins, super_mins)], dim=1)
    return out.contiguous()


def pack_int4_from_quantized(values: torch.Tensor, scales: torch.Tensor, gate_up: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack_quantized(values, scales, bits=4, gate_up=gate_up)``: symmetric int4 codes in [-8, 7] (e.g. GGUF Q4_0
    blocks, ``W = scale * q`` per group of 32), placed in ``kt.pack_int4``'s layout exactly as it would store them."""
    return pack_quantized(values, scales, bits=4, gate_up=gate_up)
