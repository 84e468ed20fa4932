"""Bridges from other libraries to the kt ops: transformers' experts interface, and checkpoint loading (safetensors folders and GGUF files, see ktorch.load)."""

from ktorch.integrations.transformers_experts import (
    IMPLEMENTATION_NAME,
    UnsupportedExpertsError,
    attach_gpu_experts,
    attach_streamed_experts,
    attach_packed_experts,
    check_supported,
    ktorch_experts_forward,
    pack_module_experts,
    packed_experts_of,
    register,
    register_when_imported,
)

__all__ = [
    "IMPLEMENTATION_NAME",
    "UnsupportedExpertsError",
    "attach_gpu_experts",
    "attach_streamed_experts",
    "attach_packed_experts",
    "check_supported",
    "ktorch_experts_forward",
    "pack_module_experts",
    "packed_experts_of",
    "register",
    "register_when_imported",
]
