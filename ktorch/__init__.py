"""ktorch: CPU/GPU hybrid inference of Mixture-of-Experts models as a native part of PyTorch.

Importing ktorch loads the ``kt`` op library (``torch.ops.kt.*``) and registers the fake impls that let
``torch.compile`` trace the ops.
"""

from ktorch._library import cpu_features, get_num_threads, load_library, set_num_threads

load_library()

from ktorch import config  # noqa: E402  (the settings: ktorch.config.set_cpu_kernel, ..., README "Settings")
from ktorch.ops import PackedExperts, fused_moe, pack_experts  # noqa: E402

__all__ = ["PackedExperts", "config", "cpu_features", "fused_moe", "get_num_threads", "pack_experts", "set_num_threads"]

# transformers integration: "ktorch" joins transformers' experts implementations (once transformers loads them),
# and prepare() places a model for hybrid CPU-expert inference.
from ktorch.integrations import register_when_imported as _register_experts_implementation  # noqa: E402
from ktorch.experts_profile import ExpertsProfile, profile_experts  # noqa: E402
from ktorch.generation import generate  # noqa: E402
from ktorch.loading import load  # noqa: E402
from ktorch.placement import (gpu_placement, prefill_split_stats, prepare, set_deferred_experts,  # noqa: E402
                              set_stream_experts, stream_plan)

# the compile backend's runtime ops (torch.ops.ktorch.submit_experts, wait_experts, ...), which the FX passes name
import ktorch.compile  # noqa: E402, F401

_register_experts_implementation()
from ktorch import lora  # noqa: E402,F401  (LoRA beside the packed experts: ktorch.lora)
__all__ += ["ExpertsProfile", "generate", "gpu_placement", "load", "prefill_split_stats", "prepare", "profile_experts", "set_deferred_experts", "set_stream_experts", "stream_plan"]
