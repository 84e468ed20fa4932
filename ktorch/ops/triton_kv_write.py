"""A static KV cache's write of one step's new key and value rows, in one Triton launch.

    pos            = cumulative_length + s                         s = 0..S-1, read on the device
    keys[b, h, pos]   = key_states[b, h, s]                        keys   [B, Hkv, L, Dk]  key_states   [B, Hkv, S, Dk]
    values[b, h, pos] = value_states[b, h, s]                      values [B, Hkv, L, Dv]  value_states [B, Hkv, S, Dv]
    cumulative_length += S

What transformers' ``StaticLayer.update`` does (transformers/cache_utils.py) with ``arange + cumulative_length``,
``cumulative_length.add_`` and two ``index_copy_`` calls: four to five launches a layer, 0.22 ms of a 5.15 ms
captured decode step (device, H200 host, the 48-layer Qwen3-30B-A3B-shaped file, every expert resident). One
program does it all: it reads the counter, copies the B * Hkv * S rows of both tensors in tiles of ``ROW_TILE`` rows
(the new rows at any strides with a unit stride along the head: the attention's transposed projections are read in
place), then, after a barrier (every thread has read the counter), advances the counter. A copy: the cache holds
exactly the new rows' bits, as index_copy_ leaves it.

Limits: keys/values contiguous, of the new rows' dtype; head sizes up to ``MAX_HEAD_DIM``, at most ``MAX_ROWS`` new
rows; CUDA tensors (or CPU tensors under Triton's interpreter, TRITON_INTERPRET=1, for tests); ``cumulative_length``
an int64 0-d tensor on their device. The row count is a compile-time constant (one compile for a decode step's
shape). Rows whose position falls past the cache (pos >= L) are not written (index_copy_ fails a device-side assert
there; ``generate``'s caches are sized for the whole generation). One program: meant for a decode step's few rows
(the swap, ktorch/integrations/transformers_cache.py, takes it for S <= 64).
"""

import torch  # no "from __future__ import annotations": Triton reads the tl.constexpr annotations

from ktorch.ops.triton_experts import (interpreting, kernel_runs_on, next_power_of_2, pdl_options,  # noqa: F401
                                      triton, triton_available)

MAX_HEAD_DIM = 1024
MAX_ROWS = 4096  # B * Hkv * S: one program copies them all (a decode step: Hkv rows)
ROW_TILE = 16  # rows a tile of the copy (decode with 4 to 16 key/value heads: one tile)


if triton is not None:
    import triton.language as tl

    from ktorch.ops.triton_experts import pdl_prologue

    @triton.jit
    def _kv_write(k_new, v_new, keys, values, length_ptr, H, S, L, skb, skh, sks, svb, svh, svs, DK, DV,
                  ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
                  PDL: tl.constexpr = 0):
        # ROWS = B * Hkv * S, a constexpr: the loop's bounds are constants (a decode step has one shape), which
        # Triton's interpreter also needs (it cannot iterate to a runtime bound under numpy 2)
        pdl_prologue(PDL)
        start = tl.load(length_ptr)
        ok = tl.arange(0, BLOCK_DK)
        ov = tl.arange(0, BLOCK_DV)
        for r0 in range(0, ROWS, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)  # rows (b, h, s), s fastest
            s = (r % S).to(tl.int64)
            bh = (r // S).to(tl.int64)
            h = bh % H
            b = bh // H
            pos = start + s
            live = (r < ROWS) & (pos < L)
            dst = bh * L + pos
            k = tl.load(k_new + (b * skb + h * skh + s * sks)[:, None] + ok[None, :],
                        mask=(r < ROWS)[:, None] & (ok < DK)[None, :])
            tl.store(keys + (dst * DK)[:, None] + ok[None, :], k, mask=live[:, None] & (ok < DK)[None, :])
            v = tl.load(v_new + (b * svb + h * svh + s * svs)[:, None] + ov[None, :],
                        mask=(r < ROWS)[:, None] & (ov < DV)[None, :])
            tl.store(values + (dst * DV)[:, None] + ov[None, :], v, mask=live[:, None] & (ov < DV)[None, :])
        tl.debug_barrier()  # every thread has read the counter before it moves
        tl.store(length_ptr, start + S)


def write_kv_rows(keys: torch.Tensor, values: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor,
                  cumulative_length: torch.Tensor) -> None:
    """keys [B, Hkv, L, Dk] and values [B, Hkv, L, Dv] (contiguous, the static cache), key_states [B, Hkv, S, Dk] and
    value_states [B, Hkv, S, Dv] (the step's new rows, any strides), cumulative_length (int64, 0-d, on their device):
    writes the new rows at positions cumulative_length + 0..S-1 and adds S to cumulative_length, in one launch.
    Shape-static and free of host syncs (CUDA-graph capturable)."""
    for name, t in (("keys", keys), ("values", values), ("key_states", key_states), ("value_states", value_states)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"write_kv_rows: {name} must be a 4-d tensor [B, Hkv, L or S, D], got {got}")
    B, H, L, DK = keys.shape
    S = key_states.shape[2]
    DV = values.shape[3]
    if values.shape[:3] != (B, H, L):
        raise ValueError(f"write_kv_rows: values must be [B={B}, Hkv={H}, L={L}, Dv] like keys, got "
                         f"{tuple(values.shape)}")
    if key_states.shape != (B, H, S, DK) or value_states.shape != (B, H, S, DV):
        raise ValueError(f"write_kv_rows: key_states [B={B}, Hkv={H}, S, Dk={DK}] and value_states [B, Hkv, S, "
                         f"Dv={DV}] matching the cache, got {tuple(key_states.shape)} and {tuple(value_states.shape)}")
    if key_states.dtype != keys.dtype or value_states.dtype != values.dtype:
        raise ValueError(f"write_kv_rows: key_states/value_states must have the cache's dtypes ({keys.dtype}, "
                         f"{values.dtype}), got {key_states.dtype} and {value_states.dtype}")
    if not keys.is_contiguous() or not values.is_contiguous():
        raise ValueError("write_kv_rows: keys and values (the static cache) must be contiguous")
    if B * H * S > MAX_ROWS:
        raise ValueError(f"write_kv_rows: at most {MAX_ROWS} new rows (B * Hkv * S) in its one program, got "
                         f"{B} * {H} * {S}")
    if max(DK, DV) > MAX_HEAD_DIM:
        raise ValueError(f"write_kv_rows: head sizes up to {MAX_HEAD_DIM}, got Dk={DK}, Dv={DV}")
    if (not isinstance(cumulative_length, torch.Tensor) or cumulative_length.dtype != torch.int64
            or cumulative_length.dim() != 0):
        got = ((cumulative_length.dtype, tuple(cumulative_length.shape)) if isinstance(cumulative_length, torch.Tensor)
               else type(cumulative_length).__name__)
        raise ValueError(f"write_kv_rows: cumulative_length must be an int64 0-d tensor, got {got}")
    devices = {t.device for t in (keys, values, key_states, value_states, cumulative_length)}
    if len(devices) != 1:
        raise ValueError(f"write_kv_rows: keys, values, key_states, value_states and cumulative_length must be on one "
                         f"device, got {sorted(str(d) for d in devices)}")
    if triton is None:
        raise RuntimeError("write_kv_rows: Triton is not installed (the decode step keeps transformers' update "
                           "without it: ktorch/integrations/transformers_cache.py)")
    if not kernel_runs_on(keys):
        raise ValueError(f"write_kv_rows: the Triton kernel runs on CUDA tensors (CPU ones only under Triton's "
                         f"interpreter, TRITON_INTERPRET=1), keys are on {keys.device}")
    if key_states.stride(3) != 1:
        key_states = key_states.contiguous()
    if value_states.stride(3) != 1:
        value_states = value_states.contiguous()
    rows = B * H * S
    _kv_write[(1,)](key_states, value_states, keys, values, cumulative_length, H, S, L, *key_states.stride()[:3],
                    *value_states.stride()[:3], DK, DV, ROWS=rows, BLOCK_R=min(next_power_of_2(rows), ROW_TILE),
                    BLOCK_DK=next_power_of_2(DK), BLOCK_DV=next_power_of_2(DV), num_warps=4,
                    **pdl_options(keys))
