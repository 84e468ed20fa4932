"""Python wrappers of the ``torch.ops.kt`` ops, with their fake impls."""

from ktorch.ops.moe import FORMATS, PackedExperts, fused_moe, pack_experts
from ktorch.ops.numa_split import NumaSplitExperts, numa_split_count

__all__ = ["FORMATS", "NumaSplitExperts", "PackedExperts", "fused_moe", "numa_split_count", "pack_experts"]
