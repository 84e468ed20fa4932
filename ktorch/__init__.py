"""ktorch: CPU/GPU hybrid inference of Mixture-of-Experts models as a native part of PyTorch.

Importing ktorch loads the ``kt`` op library (``torch.ops.kt.*``) and registers the fake impls that let
``torch.compile`` trace the ops.
"""

from ktorch._library import cpu_features, load_library

load_library()

from ktorch.ops import PackedExperts, fused_moe, pack_experts  # noqa: E402

__all__ = ["PackedExperts", "cpu_features", "fused_moe", "pack_experts"]
