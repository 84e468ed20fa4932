"""An eager prefill's rotary embedding in one launch for q and one for k: an experiment until measured.

transformers' attention modules call their modeling module's ``apply_rotary_pos_emb(q, k, cos, sin)``; in the
standard form (Llama's, copied into Qwen2/3(-MoE), Mixtral, OLMoE and most others) it is about fourteen launches a
layer for q and k. ``swapped(model)`` replaces, for the duration, that function in the modeling module of each
attention class whose function has the standard code (bytecode, constants and names as Llama's, and its
``rotate_half`` too) by one that runs ktorch/ops/triton_rope.py's kernel on q and on k where it applies (CUDA, the
default ``unsqueeze_dim=1``, the kernel's limits) and the original elsewhere. Its values differ from the eager
form's in the last bit of some elements (one rounding instead of three).

Not opened by ktorch itself: ``benchmarks/bench_generate.py --prefill-profile N --prefill-variants default
"rope kernel"`` measures it against the default on the device; the winner stays, as fused_norms.py did.
"""

from __future__ import annotations

import contextlib
import sys

from torch import nn

from ktorch.ops import triton_rope

_STANDARD: dict = {}


def _code(fn) -> tuple:
    c = getattr(fn, "__code__", None)
    return None if c is None else (c.co_code, c.co_consts, c.co_names)


def _standard(name: str):
    if name not in _STANDARD:
        try:
            from transformers.models.llama import modeling_llama
        except ImportError:
            return None
        _STANDARD[name] = _code(getattr(modeling_llama, name, None))
    return _STANDARD[name]


def standard_code(fn) -> bool:
    """Whether ``fn`` has the code of Llama's ``apply_rotary_pos_emb``."""
    return _code(fn) is not None and _code(fn) == _standard("apply_rotary_pos_emb")


def standard_module(module) -> bool:
    """Whether a modeling module's ``apply_rotary_pos_emb`` and ``rotate_half`` are Llama's."""
    fn, half = getattr(module, "apply_rotary_pos_emb", None), getattr(module, "rotate_half", None)
    return fn is not None and half is not None and standard_code(fn) and _code(half) == _standard("rotate_half")


def _fused(original):
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, **kwargs):
        if kwargs or unsqueeze_dim != 1 or not (triton_rope.rope_applies(q, cos, sin)
                                                and triton_rope.rope_applies(k, cos, sin)):
            return original(q, k, cos, sin, unsqueeze_dim, **kwargs)
        return triton_rope.rope(q, cos, sin), triton_rope.rope(k, cos, sin)

    apply_rotary_pos_emb.kt_original = original
    return apply_rotary_pos_emb


@contextlib.contextmanager
def swapped(model: nn.Module):
    """Within: the standard ``apply_rotary_pos_emb`` of the modeling modules of ``model``'s attention classes runs
    the kernel (module docstring). Yields the modeling modules swapped."""
    modules = []
    for m in model.modules():
        if not type(m).__name__.endswith("Attention"):
            continue
        module = sys.modules.get(type(m).__module__)
        if module is not None and module not in modules and standard_module(module):
            modules.append(module)
    originals = [module.apply_rotary_pos_emb for module in modules]
    for module, original in zip(modules, originals):
        module.apply_rotary_pos_emb = _fused(original)
    try:
        yield modules
    finally:
        for module, original in zip(modules, originals):
            module.apply_rotary_pos_emb = original
