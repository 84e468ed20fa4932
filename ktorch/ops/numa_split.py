"""NUMA tensor parallelism for the fused-MoE op: experts cut along the intermediate dimension, one slice per node.

``out = sum_g fused_moe(x, slice g)`` because the down projection is linear in the intermediate channels.
``PackedExperts.split_numa(n)`` (or ``pack_experts(..., numa_split=n)``) cuts a layer once, at packing time,
with ``torch.ops.kt.numa_split_experts``: slice g's tensors are allocated and first written by threads bound
to node g's CPUs (and mbind(2) to node g), so they live in node g's memory. ``ktorch.ops.fused_moe`` then runs
``torch.ops.kt.fused_moe_numa``: each slice on its own node's threads at the same time, and the fp32 partial
outputs summed in slice order. int8/int4 slices quantize the down projection's input h with each row's scale
over all slices (exchanged between gate/up and the down projection), as the unsplit op does, so every format
gives the unsplit result up to fp32 summation order. ``torch.ops.kt.fused_moe`` itself is unchanged.

``KT_NUMA_SPLIT`` or ``ktorch.config.set_numa_split`` (read on every ``ktorch.ops.fused_moe`` call and by
``split_numa()`` without an argument):
unset, empty or 1: off; ``auto``: the number of NUMA nodes with CPUs this process may use; n >= 2: n slices.
On a machine with fewer nodes than n the process's CPUs are cut into n groups, so the same code path runs on
one node. Eager CPU feature: the ops have fake impls, but the transformers integration and the compile
backend still call ``kt.fused_moe`` with unsplit weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Union

import torch

from ktorch.ops.packed_weights import MXFP4_DTYPE, kscales_as_float

if TYPE_CHECKING:
    from ktorch.ops.moe import PackedExperts


def numa_split_count(n: Union[int, str, None] = None) -> int:
    """The number of slices a split asks for: n itself, "auto" (NUMA node count), or None (``KT_NUMA_SPLIT``)."""
    if n is None:
        from ktorch import config

        n = config.value("KT_NUMA_SPLIT") or 1
    if isinstance(n, str):
        if n == "auto":
            return int(torch.ops.kt.numa_node_count())
        try:
            n = int(n)
        except ValueError:
            raise ValueError(f"KT_NUMA_SPLIT / numa_split must be 'auto' or a positive integer, got {n!r}") from None
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"numa_split must be 'auto' or a positive integer, got {n!r}")
    return n


@dataclass
class NumaSplitExperts:
    """One MoE layer's experts cut into ``len(slices)`` slices of the intermediate dimension, slice g on node g.

    Each slice is a ``PackedExperts`` of the same format with I_g intermediate channels (sum of I_g = I; each
    a multiple of 32, and of the int4 group size). Pass it to ``ktorch.ops.fused_moe`` like a ``PackedExperts``.
    """

    slices: list
    format: str
    group_size: Optional[int] = None

    @property
    def num_slices(self) -> int:
        return len(self.slices)

    @property
    def num_experts(self) -> int:
        return self.slices[0].num_experts

    @property
    def hidden_size(self) -> int:
        return self.slices[0].hidden_size

    @property
    def intermediate_size(self) -> int:
        return sum(s.intermediate_size for s in self.slices)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slices)

    def op_args(self) -> tuple:
        """(w13 list, w13_scales list, w2 list, w2_scales list) as ``kt.fused_moe_numa`` takes them."""
        quantized = self.format != "bf16"
        return (
            [s.w13 for s in self.slices],
            [s.w13_scales for s in self.slices] if quantized else [],
            [s.w2 for s in self.slices],
            [s.w2_scales for s in self.slices] if quantized else [],
        )

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights the slices stand for, put back together: (gate_up_proj [E, 2I, H], down_proj [E, H, I]), fp32."""
        gates, ups, downs = [], [], []
        for s in self.slices:
            gate_up, down = s.dequantize()
            gate, up = gate_up.chunk(2, dim=1)
            gates.append(gate)
            ups.append(up)
            downs.append(down)
        return torch.cat(gates + ups, dim=1), torch.cat(downs, dim=2)


def split_packed_experts(packed: "PackedExperts", n: Union[int, str, None] = None) -> NumaSplitExperts:
    """Cuts ``packed`` into n slices of the intermediate dimension, each placed on its NUMA node (see module doc)."""
    n = numa_split_count(n)
    w13s, s13s, w2s, s2s = torch.ops.kt.numa_split_experts(packed.w13, packed.w13_scales, packed.w2, packed.w2_scales, n)
    if not s13s:
        s13s = s2s = [None] * n
    slices = [type(packed)(a, b, c, d, packed.format, packed.group_size) for a, b, c, d in zip(w13s, s13s, w2s, s2s)]
    return NumaSplitExperts(slices, packed.format, packed.group_size)


def fused_moe_split(
    hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, split: NumaSplitExperts, activation: str
) -> torch.Tensor:
    return torch.ops.kt.fused_moe_numa(hidden, topk_ids, topk_weights, *split.op_args(), activation)


# ---------------------------------------------------------------- fake impls (shapes only, for tracing)


def slice_bounds(intermediate: int, unit: int, n: int) -> list[int]:
    """Channel bounds of the n slices, as numa_split.cpp computes them."""
    units = intermediate // unit
    if intermediate % unit or units < n:
        raise RuntimeError(f"numa_split_experts: cannot split the intermediate size I={intermediate} into {n} slices "
                           f"of multiples of {unit} channels")
    return [unit * (units * g // n) for g in range(n + 1)]


@torch.library.register_fake("kt::numa_split_experts")
def _numa_split_experts_fake(w13, w13_scales, w2, w2_scales, n):
    E, nb13, kq13, _, per13 = w13.shape
    I = nb13 * 8
    # scales at the file's size (two-level K-quant, float16): the slices hold their float32 form (numa_split.cpp)
    w13_scales = kscales_as_float(w13_scales, w2.shape[1] * 16)
    w2_scales = kscales_as_float(w2_scales, I)
    q = {torch.bfloat16: 2, torch.int8: 4, torch.uint8: 8, MXFP4_DTYPE: 8}[w13.dtype]
    unit = 32
    if q == 8:
        unit = math.lcm(32, I // w2_scales.shape[1])
    b = slice_bounds(I, unit, n)
    w13s, s13s, w2s, s2s = [], [], [], []
    for g in range(n):
        i0, i1 = b[g], b[g + 1]
        w13s.append(w13.new_empty((E, (i1 - i0) // 8, kq13, 16, per13)))
        w2s.append(w2.new_empty((E, w2.shape[1], (i1 - i0) // q, 16, w2.shape[4])))
        if w13_scales is not None:
            s13s.append(w13_scales.new_empty((E, w13_scales.shape[1], 2 * (i1 - i0))))
            G2 = w2_scales.shape[1]
            s2s.append(w2_scales.new_empty((E, 1 if G2 == 1 else G2 * (i1 - i0) // I, w2_scales.shape[2])))
    return w13s, s13s, w2s, s2s


@torch.library.register_fake("kt::fused_moe_numa")
def _fused_moe_numa_fake(hidden, topk_ids, topk_weights, w13, w13_scales, w2, w2_scales, activation="silu"):
    torch._check(len(w13) >= 1 and len(w2) == len(w13), lambda: "fused_moe_numa: w13 and w2 need one tensor per slice")
    torch._check(topk_ids.shape[0] == hidden.shape[0], lambda: "fused_moe_numa: topk_ids must have T rows")
    torch._check(hidden.shape[1] == w2[0].shape[1] * 16, lambda: "fused_moe_numa: hidden size does not match w2")
    return torch.empty_like(hidden, memory_format=torch.contiguous_format)

