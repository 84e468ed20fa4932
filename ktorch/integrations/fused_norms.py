"""One kernel per RMSNorm in an eager prefill on a GPU.

transformers' RMSNorm modules of the standard form (Llama's, copied into Qwen2/3(-MoE), Mixtral, OLMoE,
DeepSeek-V3 and most others) are written as six tensor ops:

    x32 = x.float(); v = x32.pow(2).mean(-1, keepdim=True); x32 = x32 * rsqrt(v + eps); weight * x32.to(x.dtype)

Run eagerly that is about eight launches and as many trips through the dispatcher, and an eager prefill on a GPU is
bound by the launching thread (device, session 35, H200 host, 48-layer Qwen3-30B-A3B-shaped Q8_0 file: ~130 ATen
ops a layer with every expert resident, ~16 us each, the GPU busy a third of the wall; four norms a layer).
``swapped(model)`` gives each such module a forward ``torch.nn.functional.rms_norm(x, shape, weight, eps)``: one op,
one launch. ``ktorch.generation.Decoder.prefill`` opens it on CUDA (the compiled decode step fuses the norms
itself; the CPU path is not launch-bound). Measured (same call, `bench_generate.py --prefill-profile 3
--prefill-variants default "fused norms"`): P=512 132.7 -> 99.9 ms warm, 5304 -> 3953 launches a profiled prefill,
the same first tokens.

Values: the fused op multiplies by the weight before its one rounding to the input's dtype, where the standard
form rounds the normalized activations first, then rounds the product: the two differ in the last bit of some
elements. Which modules: the class's forward has the same code as ``LlamaRMSNorm.forward`` (bytecode, constants
and names: so a family with another form, e.g. Gemma's ``1 + weight``, is left alone), its only parameter is
``weight``, it has ``variance_epsilon``, and it has no forward of its own on the instance (another swap, a hook
library's). A call whose input dtype is not the weight's runs the module's own forward (its type promotion).
"""

from __future__ import annotations

import contextlib
import types
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

_STANDARD: Optional[tuple] = None


def _standard_code() -> Optional[tuple]:
    global _STANDARD
    if _STANDARD is None:
        try:
            from transformers.models.llama.modeling_llama import LlamaRMSNorm
        except ImportError:
            return None
        c = LlamaRMSNorm.forward.__code__
        _STANDARD = (c.co_code, c.co_consts, c.co_names)
    return _STANDARD


def standard_norm(m: nn.Module) -> bool:
    """Whether ``m`` is an RMSNorm of the standard form that ``swapped`` gives a fused forward."""
    forward = getattr(type(m), "forward", None)
    code = getattr(forward, "__code__", None)
    standard = _standard_code()
    if code is None or standard is None or (code.co_code, code.co_consts, code.co_names) != standard:
        return False
    if not hasattr(m, "variance_epsilon") or "forward" in m.__dict__:
        return False
    return [n for n, _ in m.named_parameters(recurse=False)] == ["weight"] and not list(m.children())


def _fused_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    if hidden_states.dtype != self.weight.dtype:
        return type(self).forward(self, hidden_states)
    return F.rms_norm(hidden_states, self.weight.shape, self.weight, self.variance_epsilon)


def norms_of(model: nn.Module) -> list:
    """The model's standard RMSNorm modules (found once, cached on the model)."""
    found = model.__dict__.get("_kt_standard_norms")
    if found is None:
        found = [m for m in model.modules() if standard_norm(m)]
        model.__dict__["_kt_standard_norms"] = found
    return found


@contextlib.contextmanager
def swapped(model: nn.Module):
    """Within: each standard RMSNorm of ``model`` runs ``F.rms_norm`` (one kernel). Yields the modules swapped."""
    modules = [m for m in norms_of(model) if "forward" not in m.__dict__]
    for m in modules:
        m.forward = types.MethodType(_fused_forward, m)
    try:
        yield modules
    finally:
        for m in modules:
            m.__dict__.pop("forward", None)
