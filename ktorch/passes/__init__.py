"""FX passes of the ktorch compile backend, one concern per module (see README.md in this folder)."""

from ktorch.passes.async_boundary import Boundary, insert_async_boundaries, is_pure, overlap_independent_work
from ktorch.passes.partition import ExpertsCall, find_cpu_experts, mark_partition

__all__ = [
    "Boundary",
    "ExpertsCall",
    "find_cpu_experts",
    "insert_async_boundaries",
    "is_pure",
    "mark_partition",
    "overlap_independent_work",
]
