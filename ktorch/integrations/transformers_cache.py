"""transformers' static KV cache written by one Triton launch a layer in the captured decode step.

``StaticLayer.update`` (transformers/cache_utils.py) writes a step's new key and value rows with
``arange + cumulative_length``, ``cumulative_length.add_`` and two ``index_copy_`` calls: 0.22 ms of a 5.15 ms
captured decode step on the 48-layer Qwen3-30B-A3B shape (device, H200 host). ``swapped(cache)`` gives each of the
cache's ``StaticLayer``s (that class exactly: sliding and other subclasses keep theirs) an update that does the same
in one kernel (ktorch/ops/triton_kv_write.py: the rows at cumulative_length + 0..S-1, then the counter advanced by
S) and returns the same tensors, for the duration of ``Decoder.capture``; transformers' own update runs everywhere
else (prefill, ``model.generate``, serving).

Before the first swap a probe checks that this transformers' update does what the kernel does (``update_fits``):
two fresh layers on the device, a prompt written by the original update into both, then steps of 1 and 2 rows
written by the original into one and by the swap into the other, with a ``cache_position`` argument that disagrees
with the counter (an update that wrote at the position it is handed would differ here): the caches, counters and
returned tensors must be equal, bit for bit. The swapped update falls back to the class's own for an uninitialized
layer, more than ``DECODE_MAX_TOKENS`` rows, shapes or dtypes the cache does not hold, or where the kernel cannot
run (no Triton, not CUDA).
"""

from __future__ import annotations

import contextlib
import types

import torch

from ktorch.ops import triton_kv_write

DECODE_MAX_TOKENS = 64  # rows a call takes the kernel for (a decode step writes 1); prefill keeps index_copy_
_FITS: dict = {}  # (update function, device) -> whether the kernel does what it does


def _kernel_fits(layer, key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
    keys, values, length = layer.keys, layer.values, layer.cumulative_length
    return (key_states.dim() == 4 and value_states.dim() == 4 and key_states.shape[-2] <= DECODE_MAX_TOKENS
            and key_states.shape[:2] == keys.shape[:2] and key_states.shape[3] == keys.shape[3]
            and value_states.shape[:3] == (keys.shape[0], keys.shape[1], key_states.shape[2])
            and value_states.shape[3] == values.shape[3]
            and key_states.dtype == keys.dtype and value_states.dtype == values.dtype
            and keys.is_contiguous() and values.is_contiguous()
            and isinstance(length, torch.Tensor) and length.dtype == torch.int64 and length.dim() == 0
            and len({t.device for t in (keys, values, length, key_states, value_states)}) == 1
            and max(keys.shape[3], values.shape[3]) <= triton_kv_write.MAX_HEAD_DIM
            and key_states.shape[0] * key_states.shape[1] * key_states.shape[2] <= triton_kv_write.MAX_ROWS
            and triton_kv_write.kernel_runs_on(keys))


def _decode_update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
    """The swapped ``StaticLayer.update``: the kernel where it fits (``_kernel_fits``), else the class's own."""
    if not self.is_initialized or not _kernel_fits(self, key_states, value_states):
        return type(self).update(self, key_states, value_states, *args, **kwargs)
    triton_kv_write.write_kv_rows(self.keys, self.values, key_states, value_states, self.cumulative_length)
    return self.keys, self.values


@torch.no_grad()
def update_fits(device: torch.device) -> bool:
    """Whether transformers' ``StaticLayer.update`` writes what ``_decode_update`` writes (module docstring), on
    ``device``; kept per update function and device."""
    from transformers.cache_utils import StaticLayer

    device = torch.device(device)
    if not triton_kv_write.kernel_runs_on(torch.empty(0, device=device)):
        return False
    key = (StaticLayer.update, device)
    if key not in _FITS:
        _FITS[key] = _probe(StaticLayer, device)
    return _FITS[key]


def _probe(cls, device: torch.device) -> bool:
    gen = torch.Generator().manual_seed(20261126)

    def rows(s: int, d: int) -> torch.Tensor:  # [1, 3 heads, s, d], laid out as the attention's projections are
        return torch.randn(1, s, 3, d, generator=gen).transpose(1, 2).to(device)

    try:
        theirs, ours = cls(max_cache_len=16), cls(max_cache_len=16)
        k, v = rows(5, 8), rows(5, 4)
        theirs.update(k, v)
        ours.update(k, v)
        for s in (1, 2, 1):
            k, v = rows(s, 8), rows(s, 4)
            bogus = {"cache_position": torch.arange(s, device=device) + 9}
            want = cls.update(theirs, k, v, bogus)
            got = _decode_update(ours, k, v, bogus)
            if not (got[0] is ours.keys and got[1] is ours.values and want[0] is theirs.keys
                    and want[1] is theirs.values and torch.equal(ours.keys, theirs.keys)
                    and torch.equal(ours.values, theirs.values)
                    and torch.equal(ours.cumulative_length, theirs.cumulative_length)):
                return False
        return True
    except Exception:  # a layer that does not take these calls is not the update the kernel stands in for
        return False


@contextlib.contextmanager
def swapped(cache):
    """While open, each ``StaticLayer`` of ``cache`` (transformers' static cache) updates through ``_decode_update``;
    nothing is swapped where the kernel cannot run or the probe (``update_fits``) finds another update."""
    swaps = []
    try:
        from transformers.cache_utils import StaticLayer

        layers = [layer for layer in getattr(cache, "layers", ()) if type(layer) is StaticLayer]
        device = next((layer.keys.device for layer in layers if layer.is_initialized), None)
        if device is not None and update_fits(device):
            for layer in layers:
                layer.update = types.MethodType(_decode_update, layer)
                swaps.append(layer)
        yield swaps
    finally:
        for layer in swaps:
            layer.__dict__.pop("update", None)
