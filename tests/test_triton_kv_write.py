"""The static KV cache's one-launch write (ktorch/ops/triton_kv_write.py) and transformers' ``StaticLayer.update``
swapped onto it in the captured decode step (ktorch/integrations/transformers_cache.py).

The kernel runs on CUDA, or on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1 with Triton installed);
without either those tests skip, and the argument checks still run. A copy: compared bit for bit with index_copy_
and with transformers' own update, the model's logits too.
"""

from __future__ import annotations

import pytest
import torch

from ktorch.integrations import transformers_cache
from ktorch.ops import triton_kv_write
from ktorch.ops.triton_kv_write import write_kv_rows
from models import tiny_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS_RUN = triton_kv_write.triton_available() and (torch.cuda.is_available() or triton_kv_write.interpreting())
needs_kernels = pytest.mark.skipif(
    not KERNELS_RUN,
    reason="the Triton KV write needs Triton and a CUDA GPU, or Triton's interpreter (TRITON_INTERPRET=1)")


def _rows(B, H, S, D, dtype, gen, transposed=True):
    """New rows [B, H, S, D] as the attention makes them (projected [B, S, H, D], then transposed), or contiguous."""
    if transposed:
        return torch.randn(B, S, H, D, generator=gen).to(dtype).transpose(1, 2).to(DEVICE)
    return torch.randn(B, H, S, D, generator=gen).to(dtype).to(DEVICE)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("B,H,S,DK,DV,L,start", [(1, 4, 1, 128, 128, 256, 37), (1, 2, 3, 16, 8, 12, 5),
                                                 (2, 3, 2, 64, 64, 32, 0), (1, 8, 64, 32, 32, 300, 200),
                                                 (1, 1, 1, 80, 96, 16, 15)])
def test_kernel_writes_what_index_copy_writes(dtype, B, H, S, DK, DV, L, start):
    gen = torch.Generator().manual_seed(B * 1000 + H * 100 + S)
    keys = torch.randn(B, H, L, DK, generator=gen).to(dtype).to(DEVICE)
    values = torch.randn(B, H, L, DV, generator=gen).to(dtype).to(DEVICE)
    want_k, want_v = keys.clone(), values.clone()
    for transposed in (True, False):
        k, v = _rows(B, H, S, DK, dtype, gen, transposed), _rows(B, H, S, DV, dtype, gen, transposed)
        length = torch.tensor(start, device=DEVICE)
        position = torch.arange(S, device=DEVICE) + length
        want_k.index_copy_(2, position, k)
        want_v.index_copy_(2, position, v)
        write_kv_rows(keys, values, k, v, length)
        assert torch.equal(keys, want_k) and torch.equal(values, want_v)
        assert length.item() == start + S


@needs_kernels
def test_rows_past_the_cache_are_not_written():
    """index_copy_ would fail a device-side assert there; the kernel writes the rows that fit, the counter advances."""
    keys, values = torch.zeros(1, 2, 8, 16, device=DEVICE), torch.zeros(1, 2, 8, 16, device=DEVICE)
    k, v = torch.ones(1, 2, 3, 16, device=DEVICE), torch.full((1, 2, 3, 16), 2.0, device=DEVICE)
    length = torch.tensor(6, device=DEVICE)
    write_kv_rows(keys, values, k, v, length)
    assert keys[:, :, 6:].eq(1).all() and values[:, :, 6:].eq(2).all() and keys[:, :, :6].eq(0).all()
    assert length.item() == 9


def test_bad_inputs_name_the_argument(monkeypatch):
    """Refused before any kernel runs (so these run without Triton too)."""
    keys, values = torch.zeros(1, 2, 8, 16), torch.zeros(1, 2, 8, 8)
    k, v, n = torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 8), torch.tensor(0)
    cases = [((keys[0], values, k, v, n), "keys must be a 4-d"), ((keys, values, k[0], v, n), "key_states must"),
             ((keys, torch.zeros(1, 3, 8, 8), k, v, n), "values must be"),
             ((keys, values, torch.zeros(1, 2, 1, 8), v, n), "key_states .* and value_states"),
             ((keys, values, k.half(), v, n), "dtypes"),
             ((keys.transpose(2, 3).contiguous().transpose(2, 3), values, k, v, n), "contiguous"),
             ((keys, values, k, v, torch.tensor(0, dtype=torch.int32)), "cumulative_length must"),
             ((keys, values, k, v, torch.tensor([0])), "cumulative_length must"),
             ((keys, values, k, v, 0), "cumulative_length must"),
             ((torch.zeros(1, 2, 8, 2048), torch.zeros(1, 2, 8, 8), torch.zeros(1, 2, 1, 2048), v, n), "head sizes"),
             ((torch.zeros(1, 64, 80, 8), torch.zeros(1, 64, 80, 8), torch.zeros(1, 64, 65, 8),
               torch.zeros(1, 64, 65, 8), n), "new rows")]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            write_kv_rows(*args)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="one device"):
            write_kv_rows(keys, values, k, v, n.cuda())
    monkeypatch.setattr(triton_kv_write, "kernel_runs_on", lambda t: False)
    if triton_kv_write.triton is not None:
        with pytest.raises(ValueError, match="keys are on"):
            write_kv_rows(keys, values, k, v, n)
    monkeypatch.setattr(triton_kv_write, "triton", None)
    with pytest.raises(RuntimeError, match="Triton is not installed"):
        write_kv_rows(keys, values, k, v, n)


@needs_kernels
def test_swapped_update_is_transformers_update(monkeypatch):
    """A static layer updated through the swap (prefill-sized calls: the class's own; decode-sized: the kernel)
    holds what transformers' update leaves, with the same counter and the same returned tensors; a subclass is not
    swapped; an update that wrote at the cache_position it is handed would fail the probe."""
    from transformers.cache_utils import StaticLayer

    assert transformers_cache.update_fits(torch.device(DEVICE))
    gen = torch.Generator().manual_seed(7)
    theirs, ours = StaticLayer(max_cache_len=128), StaticLayer(max_cache_len=128)
    writes = []
    real = triton_kv_write.write_kv_rows
    for S in (transformers_cache.DECODE_MAX_TOKENS + 1, 1, 1, 4, 1):
        k, v = _rows(1, 2, S, 16, torch.bfloat16, gen), _rows(1, 2, S, 16, torch.bfloat16, gen)
        want = theirs.update(k, v)
        monkeypatch.setattr(triton_kv_write, "write_kv_rows", lambda *a: writes.append(1) or real(*a))
        got = transformers_cache._decode_update(ours, k, v, {"cache_position": torch.tensor([0])})
        monkeypatch.undo()
        assert got[0] is ours.keys and got[1] is ours.values and want[0] is theirs.keys
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
        assert torch.equal(ours.cumulative_length, theirs.cumulative_length)
    assert len(writes) == 4  # the 65-row prefill (first, uninitialized) went through transformers' update

    class Sub(StaticLayer):
        pass

    class Cache:
        layers = [StaticLayer(8), Sub(8)]

    for layer in Cache.layers:
        layer.update(torch.zeros(1, 1, 1, 8, device=DEVICE), torch.zeros(1, 1, 1, 8, device=DEVICE))
    with transformers_cache.swapped(Cache) as swaps:
        assert swaps == [Cache.layers[0]] and "update" not in vars(Cache.layers[1])
    assert "update" not in vars(Cache.layers[0])

    def update_at_position(self, key_states, value_states, cache_kwargs=None, **kwargs):
        position = cache_kwargs["cache_position"]
        self.cumulative_length.add_(key_states.shape[-2])
        self.keys.index_copy_(2, position, key_states)
        self.values.index_copy_(2, position, value_states)
        return self.keys, self.values

    assert transformers_cache._probe(StaticLayer, torch.device(DEVICE))
    Other = type("Other", (StaticLayer,), {"update": update_at_position})
    assert not transformers_cache._probe(Other, torch.device(DEVICE))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_models_decode_steps_with_the_swap_are_bit_identical(dtype):
    """Prefill, then decode steps into a static cache, with and without the swap: the same logits and caches, bit
    for bit (the write is a copy)."""
    from transformers import StaticCache

    from ktorch.generation import _cache_argument

    torch.manual_seed(0)
    model = tiny_model("qwen3_moe", dtype=dtype).to(DEVICE).requires_grad_(False)
    prompt = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    steps = torch.randint(0, 256, (4,), generator=torch.Generator().manual_seed(2)).tolist()
    runs = []
    for swap in (False, True):
        cache = StaticCache(config=model.config, max_cache_len=32)
        logits = []
        with torch.no_grad():
            model(input_ids=prompt, use_cache=True, **{_cache_argument(model): cache})
            for i, token in enumerate(steps):
                position = torch.tensor([prompt.shape[1] + i], device=DEVICE)
                context = transformers_cache.swapped(cache) if swap else _nothing()
                with context as swaps:
                    if swap:
                        assert len(swaps) == model.config.num_hidden_layers
                    out = model(input_ids=torch.tensor([[token]], device=DEVICE), cache_position=position,
                                position_ids=position[None], use_cache=True, **{_cache_argument(model): cache})
                logits.append(out.logits)
        runs.append((logits, [(layer.keys, layer.values, layer.cumulative_length) for layer in cache.layers]))
    (want, want_cache), (got, got_cache) = runs
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(a, b) for x, y in zip(got_cache, want_cache) for a, b in zip(x, y))


class _nothing:
    def __enter__(self):
        return []

    def __exit__(self, *exc):
        return False
