"""FX passes of the ktorch compile backend, one concern per module (see README.md in this folder)."""

from ktorch.passes.async_boundary import Boundary, insert_async_boundaries, is_pure, overlap_independent_work
from ktorch.passes.deferral import Deferral, defer_experts, split_topk_slots
from ktorch.passes.partition import ExpertsCall, find_cpu_experts, mark_partition

__all__ = [
    "Boundary",
    "Deferral",
    "ExpertsCall",
    "defer_experts",
    "find_cpu_experts",
    "insert_async_boundaries",
    "is_pure",
    "mark_partition",
    "overlap_independent_work",
    "split_topk_slots",
]
