"""Python wrappers of the ``torch.ops.kt`` ops, with their fake impls."""

from ktorch.ops.moe import FORMATS, PackedExperts, fused_moe, pack_experts

__all__ = ["FORMATS", "PackedExperts", "fused_moe", "pack_experts"]
