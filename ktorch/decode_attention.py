"""The captured decode step's attention: FlexAttention over the static KV cache's filled blocks only.

transformers' SDPA path, traced by Dynamo (the decode step's layers are compiled regionally: ktorch/generation.py
``compiled_layers``), attends a static cache's whole length with a mask, and for grouped-query attention copies the
key and value heads to the query heads' count first (``repeat_kv``; its copy-free ``pack_gqa`` is taken only outside
Dynamo). So each layer of each step read and wrote every cached position, filled or not, and a step grew slower with
the cache's length, not the context's (device, H200 host, the 48-layer Qwen3-30B-A3B-shaped file, every expert
resident: 124.7 tok/s after a 512-token prompt, 88.3 after 2048).

Here the step calls ``flex_attention`` (compiled by Inductor into its decoding kernel, which splits the keys over
thread blocks) with a ``BlockMask`` whose block count is the step's own: ``kv_num_blocks = position // BLOCK + 1``,
set on the device at the start of each step (``DecodeAttention.update``, captured in the graph), every block after
it skipped, the last one masked to ``kv <= position`` by its ``mask_mod``; grouped-query heads read their shared key
and value heads in place (``enable_gqa``). The model builds no mask for it (the mask interface gives None).

Where it applies (``applies``): a CUDA model whose attention is transformers' "sdpa" with every layer full causal
(no sliding window, no attention sinks, no logit softcapping), equal key and value head sizes of 16 to 256 (a power
of two), batch 1 (``generate``'s decoder). Otherwise the step keeps SDPA.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn

BLOCK = 128  # key positions a block (FlexAttention's default block size); cache lengths are multiples of 256
NAME = "ktorch_decode"  # the attention implementation's name in transformers' registries while the step is captured
HEAD_DIMS = (16, 32, 64, 128, 256)


def _attention_modules(model: nn.Module) -> list:
    return [m for m in model.modules()
            if type(m).__name__.endswith("Attention") and isinstance(getattr(m, "layer_idx", None), (int, torch.Tensor))]


def applies(model: nn.Module, device: torch.device) -> Optional[str]:
    """None where the decode step can take the flex attention, else why not (a sentence)."""
    if torch.device(device).type != "cuda":
        return "not a CUDA device"
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError:
        return "this torch has no FlexAttention"
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return f"the attention implementation is {getattr(model.config, '_attn_implementation', None)!r}, not 'sdpa'"
    if getattr(config, "attn_logit_softcapping", None):
        return "softcapped attention"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding-window attention"
    modules = _attention_modules(model)
    if not modules:
        return "no attention modules found"
    for m in modules:
        if getattr(m, "sliding_window", None) or getattr(m, "sinks", None) is not None:
            return f"{type(m).__name__} has a sliding window or attention sinks"
        head = getattr(m, "head_dim", None)
        if head not in HEAD_DIMS or getattr(m, "v_head_dim", head) != head:
            return f"{type(m).__name__}'s head size {head} (FlexAttention here takes {HEAD_DIMS}, keys as values)"
    return None


# The query's position as the mask reads it: one tensor per process (re-made on another device), which every
# decoder's step copies its own position into. The mask function is then one module-level function over one tensor,
# so a new decoder (a new capture of the same model) compiles nothing anew: Dynamo guards a mask function's identity
# and the tensors it closes over.
_POSITION: Optional[torch.Tensor] = None


def _position_on(device: torch.device) -> torch.Tensor:
    global _POSITION
    if _POSITION is None or _POSITION.device != device:
        _POSITION = torch.zeros(1, dtype=torch.long, device=device)
    return _POSITION


def _causal(b, h, q, kv):
    return kv <= _POSITION[0]  # the one query sits at the step's position and sees the keys up to it


class DecodeAttention:
    """The block mask of one static cache of ``max_len`` positions (a multiple of ``BLOCK``), for the query at
    ``position`` (the decoder's [1] device tensor; ``update`` copies it for the mask and sets the block count, on
    the device, so a replay sees each step's value)."""

    def __init__(self, max_len: int, position: torch.Tensor):
        from torch.nn.attention.flex_attention import BlockMask

        if max_len % BLOCK or max_len <= 0:
            raise ValueError(f"DecodeAttention: the cache length must be a positive multiple of {BLOCK}, got {max_len}")
        if position.shape != (1,) or position.dtype != torch.long:
            raise ValueError(f"DecodeAttention: position must be a [1] int64 tensor, got {position.dtype} "
                             f"{tuple(position.shape)}")
        device = position.device
        blocks = max_len // BLOCK
        self.position = position
        self.mask_position = _position_on(device)
        self.kv_num_blocks = torch.ones(1, 1, 1, dtype=torch.int32, device=device)
        kv_indices = torch.arange(blocks, dtype=torch.int32, device=device).view(1, 1, 1, blocks)
        self.block_mask = BlockMask.from_kv_blocks(self.kv_num_blocks, kv_indices, BLOCK_SIZE=BLOCK, mask_mod=_causal,
                                                   seq_lengths=(1, max_len))

    def update(self) -> None:
        """The step's position for the mask and its block count (device ops, no host sync: captured with the
        step)."""
        if self.mask_position is not _POSITION:  # another decoder on another device re-made it since
            raise RuntimeError("ktorch: this decode attention's position tensor was replaced (a decoder on another "
                               "device); make the decoder again")
        self.mask_position.copy_(self.position)
        torch.add(torch.div(self.position, BLOCK, rounding_mode="floor"), 1, out=self.kv_num_blocks.view(1))


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
               kt_decode: Optional[DecodeAttention] = None, **kwargs) -> tuple:
    """transformers' attention interface: query [1, Hq, 1, D], key/value [1, Hkv, L, D] (the static cache) ->
    ([1, 1, Hq, D], None)."""
    from torch.nn.attention.flex_attention import flex_attention

    if kt_decode is None:
        raise RuntimeError(f"ktorch: the {NAME!r} attention is the captured decode step's (ktorch.generate); it got "
                           "no block mask (kt_decode)")
    if query.shape[0] != 1 or query.shape[2] != 1 or dropout:
        raise RuntimeError(f"ktorch: the {NAME!r} attention takes one query of batch 1 without dropout, got query "
                           f"{tuple(query.shape)}, dropout {dropout}")
    out = flex_attention(query, key, value, block_mask=kt_decode.block_mask, scale=scaling,
                         enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs):
    return None  # the block mask is the step's own (DecodeAttention)


_REGISTERED = False


def _register() -> None:
    global _REGISTERED
    if not _REGISTERED:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(NAME, _attention)
        AttentionMaskInterface.register(NAME, _no_mask)
        _REGISTERED = True


@contextlib.contextmanager
def switched(model: nn.Module):
    """While open, the model's attention (and its mask) is the decode step's (``NAME``); restored after."""
    _register()
    before = model.config._attn_implementation
    model.config._attn_implementation = NAME
    try:
        yield
    finally:
        model.config._attn_implementation = before
