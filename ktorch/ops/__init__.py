"""Python wrappers of the ``torch.ops.kt`` ops, with their fake impls."""

from ktorch.ops.moe import FORMATS, PackedExperts, fused_moe, pack_experts
from ktorch.ops import moe_autograd  # noqa: F401  (autograd of kt.fused_moe, kt.fused_moe_delta)
from ktorch.ops import train_experts  # noqa: F401  (torch.ops.ktorch.train_experts: training on the GPU)
from ktorch.ops.numa_split import NumaSplitExperts, numa_split_count
from ktorch.ops.streamed_experts import StreamPlan  # also defines torch.ops.ktorch.streamed_experts

__all__ = ["FORMATS", "NumaSplitExperts", "PackedExperts", "StreamPlan", "fused_moe", "numa_split_count", "pack_experts"]
